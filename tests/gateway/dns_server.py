"""A real DNS server for the discovery tests: UDP on 127.0.0.1, a free port, answers built with
dnspython from records the test changes while it runs (replicas appearing and disappearing behind
a name). Not a resolver: it answers only for the names it was given (NXDOMAIN for the rest).
"""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

TTL_S = 1


class TestDnsServer:
    __test__ = False  # not a pytest class

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        # (name with final dot, type) -> rdata texts, e.g. ("r.test.", "A") -> ["127.0.0.1"]
        self._records: dict[tuple[str, str], list[str]] = {}
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, rdtype: str, values: list[str]) -> None:
        """Replace the records of one name and type ([] removes them)."""
        with self._lock:
            key = (name.rstrip(".") + ".", rdtype)
            if values:
                self._records[key] = list(values)
            else:
                self._records.pop(key, None)

    def set_srv(self, name: str, ports: list[int], target: str = "replica.kvik.test") -> None:
        """SRV records of `name`: one per port, all on `target`, which gets an A record 127.0.0.1."""
        self.set(target, "A", ["127.0.0.1"] if ports else [])
        self.set(name, "SRV", [f"0 0 {port} {target.rstrip('.')}." for port in ports])

    def start(self) -> TestDnsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                query = dns.message.from_wire(data)
            except Exception:  # noqa: BLE001 - not DNS: ignore, as a server would
                continue
            self._sock.sendto(self._answer(query).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        with self._lock:
            self.queries += 1
            for question in query.question:
                name = question.name.to_text()
                rdtype = dns.rdatatype.to_text(question.rdtype)
                values = self._records.get((name, rdtype))
                if values:
                    response.answer.append(dns.rrset.from_text_list(name, TTL_S, dns.rdataclass.IN, rdtype, values))
                elif not any(key[0] == name for key in self._records):
                    response.set_rcode(dns.rcode.NXDOMAIN)
        return response
