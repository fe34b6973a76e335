"""Running the gateway: one uvicorn server, one or two listening sockets.

The main socket serves the API. With `metrics.port` set, a second socket on the same server serves
`/metrics` and nothing else (and the main socket no longer does), so the replica URLs it names are
only reachable where the operator opens that port. One server with two sockets shares one event
loop, one lifespan and one signal handler; `app.ListenerGate` tells the sockets apart by the local
port of each connection.
"""

from __future__ import annotations

from pathlib import Path

import uvicorn

from kvik.core.errors import ConfigError
from kvik.gateway.app import create_app
from kvik.web.client_limits import guarded_h11_protocol
from kvik.gateway.config import GatewayConfig


def serve(config: GatewayConfig, *, host: str, port: int, log_level: str, config_path: Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM. `host` and `port` override the config's (the command line);
    `config_path` is read again on SIGHUP, on change, and on POST /admin/config/reload."""
    metrics_port = config.metrics.port
    if metrics_port is not None and metrics_port == port:
        raise ConfigError(f"metrics.port: {metrics_port} is also the gateway's port; pick another")
    app = create_app(config, config_path)
    http = guarded_h11_protocol(config.limits.header_timeout_s)
    main = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, http=http)
    sockets = [main.bind_socket()]
    if metrics_port is not None:
        metrics_host = config.metrics.host or host
        sockets.append(uvicorn.Config(app, host=metrics_host, port=metrics_port, http=http).bind_socket())
    uvicorn.Server(main).run(sockets=sockets)
