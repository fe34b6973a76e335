"""HTTP routes: thin handlers; the logic lives in `serving` and the stores."""
