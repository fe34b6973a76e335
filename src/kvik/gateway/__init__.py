"""kvik gateway: one OpenAI-compatible front door for many model replicas.

Torch-free by contract (see the import-linter rules in pyproject.toml). A request passes, in order:
auth (`auth`) -> rate limits (`ratelimit`) -> guardrails (`guardrails`) -> response cache (`cache`)
-> replica choice (`router`, `balancing`, `breaker`, `health`) -> upstream call with failover
(`proxy`) -> usage row (`usage`) and metrics (`metrics`). `serving.ProxyService` reads top to bottom
in that order; `app.create_app` wires it to FastAPI.
"""
