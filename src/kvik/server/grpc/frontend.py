"""The gRPC server next to the HTTP one, on the same event loop and the same `ServerState`.

Services: `kvik.inference.v1.Inference` (kvik.server.grpc.service), the standard health-checking
service `grpc.health.v1.Health`, and server reflection (v1alpha, what grpcurl and grpc_cli use).

Health follows the HTTP `/health`: SERVING once the engine is ready, NOT_SERVING while loading,
draining, after a failed start, or once the engine died; for the whole server ("") and for the
Inference service by name.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvik.core.errors import ConfigError
from kvik.protocol.grpc import inference_pb2_grpc as pb_grpc
from kvik.server.grpc.service import SERVICE_NAME, InferenceService
from kvik.server.state import ServerState

logger = logging.getLogger("kvik.server.grpc")

HEALTH_POLL_S = 0.1  # seconds: how soon health follows a change of state (drain, engine death)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def serving(state: ServerState) -> bool:
    """What GET /health answers with 200."""
    return state.ready and not state.draining and state.load_error is None and not state.engine_dead


class GrpcFrontend:
    def __init__(self, state: ServerState, host: str, port: int) -> None:
        self.state = state
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._follower: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen; raises ConfigError when the port cannot be bound."""
        limit = self.state.config.max_body_bytes
        # so_reuseport off: a port another process holds must fail here, not be shared silently.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", limit)])
        pb_grpc.add_InferenceServicer_to_server(InferenceService(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        try:
            server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise ConfigError(f"--grpc-port: cannot listen on {self.address} ({exc})") from None
        await self._set_health(False)
        await server.start()
        self._server = server
        self._follower = asyncio.create_task(self._follow_health(), name="kvik-grpc-health")
        logger.info("gRPC: kvik.inference.v1.Inference, grpc.health.v1 and reflection on %s", self.address)

    async def _set_health(self, ok: bool) -> None:
        status = SERVING if ok else NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _follow_health(self) -> None:
        current: bool | None = None
        while True:
            now = serving(self.state)
            if now != current:
                await self._set_health(now)
                current = now
            await asyncio.sleep(HEALTH_POLL_S)

    async def stop(self, grace_s: float) -> None:
        """Health says NOT_SERVING for good; calls still running get `grace_s` seconds."""
        if self._follower is not None:
            self._follower.cancel()
        if self._server is None:
            return
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
