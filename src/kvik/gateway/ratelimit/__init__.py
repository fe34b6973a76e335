"""Per-key rate limits over pluggable counters (memory or Redis)."""
