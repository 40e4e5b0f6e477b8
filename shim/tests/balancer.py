"""A per-request round-robin HTTP load balancer, as an L7 balancer (nginx,
Envoy, a cloud load balancer) runs in front of several gateways: each request
goes to the next upstream over a fresh connection, and an upstream that
refuses the connection is skipped. The Rust tests have its twin
(tests/it/balancer.rs); this one serves the shim's tests and the Meltano bench."""

from __future__ import annotations

import http.client
import itertools
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Headers that belong to one connection, not to the request.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}


class Balancer:
    """Serves on a free loopback port until `stop`; `base` is its URL."""

    def __init__(self, upstreams: list[str]) -> None:
        self.upstreams = [urlsplit(u) for u in upstreams]
        self._turn = itertools.count()
        self._turn_guard = threading.Lock()
        balancer = self

        class Relay(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class names it so
                pass

            def setup(self) -> None:
                super().setup()
                # Without it each answer waits out the client's delayed ACK (~40 ms).
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def answer(self, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
                """The whole response in one write, for the same reason."""
                head = [f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}"]
                head += [f"{name}: {value}" for name, value in headers]
                head.append(f"Content-Length: {len(payload)}")
                self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)

            def relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                for upstream in balancer.order():
                    connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=400)
                    try:
                        connection.connect()
                        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        connection.request(self.command, self.path, body=body, headers=headers)
                        answer = connection.getresponse()
                        payload = answer.read()
                    except ConnectionRefusedError:
                        continue
                    finally:
                        connection.close()
                    kept = [(k, v) for k, v in answer.getheaders() if k.lower() not in HOP_BY_HOP | {"content-length"}]
                    self.answer(answer.status, kept, payload)
                    return
                self.answer(502, [], b"no upstream took the connection")

            do_GET = do_PUT = do_POST = do_PATCH = do_DELETE = relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        self._server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="balancer", daemon=True)
        self._thread.start()

    def order(self) -> list:
        """Every upstream, starting at the next one in turn."""
        with self._turn_guard:
            first = next(self._turn) % len(self.upstreams)
        return self.upstreams[first:] + self.upstreams[:first]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
