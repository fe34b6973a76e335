"""One thin router per endpoint group; the logic lives in the serving classes."""
