"""``hybridkv route serve``'s HTTP API over ``Engines``: the standard library's server.

The service's process, one thread per connection. ``POST /lookup`` takes a JSON
prompt and answers every engine's hits; ``GET /engines`` lists the engines and
their tiers; ``GET /health`` answers ``{"ok": true}``. A bad request is a 400
whose ``error`` names every problem; an engine that cannot answer comes back
with its ``error`` in place of its hits.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.keys import BlockHash, encode_token_ids
from hybridkv.route.engines import Engines
from hybridkv.route.lookup import EngineHits, HitQuery

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
QUERY_KEYS = ("token_ids", "block_hashes", "num_tokens", "cache_salt", "lora_name", "engines")


def parse_query(body: object) -> tuple[HitQuery, list[str] | None]:
    """A ``/lookup`` body as a query and the engines it names (None: every one);
    ValueError listing every problem."""
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object with keys among {list(QUERY_KEYS)}")
    problems = [
        f"unknown key {k!r}; allowed: {list(QUERY_KEYS)}" for k in body if k not in QUERY_KEYS
    ]
    token_ids = block_hashes = None
    if "token_ids" in body:
        try:
            token_ids = _token_ids(body["token_ids"])
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    if "block_hashes" in body:
        try:
            block_hashes = _block_hashes(body["block_hashes"])
        except ValueError as exc:
            problems.append(str(exc))
    for key in ("cache_salt", "lora_name"):
        if body.get(key) is not None and not isinstance(body[key], str):
            problems.append(f"{key}={body[key]!r} must be a string or null")
    num_tokens = body.get("num_tokens")
    if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 0):
        problems.append(f"num_tokens={num_tokens!r} must be an int >= 0 or null")
    names = body.get("engines")
    if names is not None and (
        not isinstance(names, list) or not all(isinstance(n, str) for n in names)
    ):
        problems.append(f"engines={names!r} must be a list of engine names or null")
    if problems:
        raise ValueError("; ".join(problems))
    query = HitQuery(
        token_ids=token_ids,
        block_hashes=block_hashes,
        num_tokens=num_tokens,
        cache_salt=body.get("cache_salt"),
        lora_name=body.get("lora_name"),
    )
    return query, names


def _token_ids(raw: object) -> npt.NDArray[np.int64]:
    if not isinstance(raw, list) or any(type(t) is not int for t in raw):
        raise TypeError("token_ids must be a list of ints")
    return encode_token_ids(raw)


def _block_hashes(raw: object) -> list[BlockHash]:
    if not isinstance(raw, list) or not all(isinstance(h, str) for h in raw):
        raise ValueError("block_hashes must be a list of hex strings")
    try:
        return [BlockHash(bytes.fromhex(h)) for h in raw]
    except ValueError:
        raise ValueError("block_hashes must be hex strings (each block's digest)") from None


def answer(engines: Engines, body: object) -> dict[str, Any]:
    """The ``/lookup`` answer for ``body``: every engine's hits and the engine with
    the most usable tokens (``best``: its tiers' or its own cache's hit, the longer;
    null when none hits)."""
    query, names = parse_query(body)
    found = engines.find(query, names)
    hits = [f for f in found if isinstance(f, EngineHits)]
    best = max(hits, key=lambda h: h.usable_tokens, default=None)
    return {
        "engines": [f.to_dict() for f in found],
        "best": None if best is None or best.usable_tokens == 0 else best.engine,
    }


class _Handler(BaseHTTPRequestHandler):
    server: RouteServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(HTTPStatus.OK, {"ok": True})
        elif self.path == "/engines":
            entries = self.server.engines.reread()
            self._send(HTTPStatus.OK, {"engines": [e.describe() for e in entries]})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}; try GET /engines"})

    def do_POST(self) -> None:
        if self.path != "/lookup":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}; try POST /lookup"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            error = f"Content-Length {length}: send a JSON body of 1..{MAX_BODY_BYTES} bytes"
            self._send(HTTPStatus.BAD_REQUEST, {"error": error})
            return
        try:
            body = json.loads(self.rfile.read(length))
            self._send(HTTPStatus.OK, answer(self.server.engines, body))
        except ValueError as exc:  # bad JSON, or a bad query
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})

    def _send(self, status: HTTPStatus, document: dict[str, Any]) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)


class RouteServer(ThreadingHTTPServer):
    """The HTTP service over ``engines``, bound to ``host:port`` (port 0: a free one)."""

    daemon_threads = True

    def __init__(self, engines: Engines, host: str, port: int) -> None:
        self.engines = engines
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> threading.Thread:
        """Serve on a thread of its own (tests, embedding); ``shutdown`` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="hybridkv-route", daemon=True)
        thread.start()
        return thread
