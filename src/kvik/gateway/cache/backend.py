"""A cached upstream answer and the interface of the stores that keep them."""

from __future__ import annotations

import base64
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CachedResponse:
    status: int
    content_type: str
    # Non-streaming: one element, the JSON body. Streaming: the SSE events as relayed, so a hit
    # replays the same chunks (and `data: [DONE]`).
    chunks: tuple[bytes, ...]

    @property
    def size(self) -> int:
        return sum(len(chunk) for chunk in self.chunks)

    def to_bytes(self) -> bytes:
        return json.dumps({"status": self.status, "content_type": self.content_type,
                           "chunks": [base64.b64encode(c).decode() for c in self.chunks]}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> CachedResponse:
        data = json.loads(raw)
        return cls(data["status"], data["content_type"], tuple(base64.b64decode(c) for c in data["chunks"]))


class ResponseCache(ABC):
    @abstractmethod
    async def get(self, key: str) -> CachedResponse | None: ...

    @abstractmethod
    async def put(self, key: str, response: CachedResponse) -> None:
        """Store unless the response is over the size bound; never raises for an oversized entry."""

    async def close(self) -> None:
        return None
