"""`kvik serve`: the OpenAI-compatible HTTP server in front of the async engine."""
