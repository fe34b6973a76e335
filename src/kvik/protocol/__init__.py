"""OpenAI wire format shared by the server and the gateway: schemas, SSE framing, error envelopes."""
