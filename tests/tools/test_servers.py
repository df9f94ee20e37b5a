"""Helpers for local servers: a health check against a real HTTP server on loopback."""

from __future__ import annotations

import http.server
import threading

from hybridkv.tools.servers import HOST, free_port, http_ok


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_http_ok_is_true_only_for_a_200_answer() -> None:
    server = http.server.ThreadingHTTPServer((HOST, 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert http_ok(f"http://{HOST}:{port}/health")
        assert not http_ok(f"http://{HOST}:{port}/starting")
    finally:
        server.shutdown()
        server.server_close()
    assert not http_ok(f"http://{HOST}:{free_port()}/health", timeout_s=0.5)
