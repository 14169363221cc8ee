"""Shared bits of the stand-in servers (stdlib only)."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


def log(msg: str) -> None:
    print(msg, flush=True)


def chunk_hashes(ids: list[int], chunk: int, count: int) -> list[str]:
    """Prefix hashes of the first ``count`` chunks (LMCache keys chunks by prefix)."""
    out = []
    h = hashlib.sha256()
    for i in range(count):
        h.update(json.dumps(ids[i * chunk:(i + 1) * chunk]).encode())
        out.append(h.copy().hexdigest()[:32])
    return out


Route = Callable[[BaseHTTPRequestHandler, Any], Any]


def serve(host: str, port: int, routes: dict[tuple[str, str], Route]) -> ThreadingHTTPServer:
    """Start a threaded HTTP server; a route returns (code, content-type, body) or a generator for SSE."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet
            pass

        def _go(self, method: str) -> None:
            path = self.path.split("?")[0]
            fn = routes.get((method, path))
            if fn is None:
                self._send(404, "text/plain", b"not found")
                return
            body = None
            if method == "POST":
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body = json.loads(raw) if raw else {}
                except ValueError:
                    self._send(400, "text/plain", b"bad json")
                    return
            try:
                res = fn(self, body)
            except Exception as exc:  # noqa: BLE001
                self._send(500, "application/json", json.dumps({"error": repr(exc)}).encode())
                return
            if res is None:
                return
            code, ctype, payload = res
            if isinstance(payload, (dict, list)):
                payload = json.dumps(payload).encode()
            elif isinstance(payload, str):
                payload = payload.encode()
            self._send(code, ctype, payload)

        def _send(self, code: int, ctype: str, payload: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:  # noqa: N802
            self._go("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._go("POST")

    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def post(url: str, body: Any, timeout: float = 30.0) -> Any:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
        return json.loads(resp.read())


def die(msg: str, code: int = 1) -> None:
    print(msg, file=sys.stderr, flush=True)
    sys.exit(code)
