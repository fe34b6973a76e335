"""The test support's port picker: two ports picked before one server binds both must differ."""

from __future__ import annotations

import socket

from tests.support.processes import free_port


def test_free_port_never_hands_out_a_port_twice() -> None:
    # The OS, asked for a free port, may return one it just returned (nothing listens on it yet);
    # `kvik serve --port P --grpc-port P` then fails to bind. CI saw exactly that.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:  # and each is bindable
        sock.bind(("127.0.0.1", ports[-1]))
