"""The dashboard's HTTP server: the static page, plotly.js from the plotly wheel, and a
JSON API over the stored jobs. Standard library only (nothing to install, starts fast).

    GET /                                  the page
    GET /static/<file>                     app.js, style.css, plotly.min.js
    GET /api/jobs                          jobs with stored metrics, newest first
    GET /api/jobs/<id>/series?since=T      samples newer than T (the page polls for live)
    GET /api/jobs/<id>/logs?lines=N        the tails of the job's logs
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import socket
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO

from dtrain.cluster.providers.cost import job_cost
from dtrain.errors import DtrainError
from dtrain.extras import require
from dtrain.monitor.head import findings as rules
from dtrain.monitor.views.jobs import JobInfo, list_jobs

STATIC = Path(__file__).parent / "static"
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".html": "text/html; charset=utf-8"}  # fmt: skip
MAX_LOG_LINES = 500
# A log tail is read from the file's end, at most MAX_LOG_BYTES of it, and each line is
# shown up to MAX_LOG_LINE characters: the page polls 200 lines of every log each 2 s, and
# reading whole files sent a 60 MB log without newlines back whole for `lines=50`.
MAX_LOG_BYTES = 1 << 20
MAX_LOG_LINE = 4096
LINE_CUT = " [… line cut]"  # after a line's first MAX_LOG_LINE characters
START_CUT = "[line cut …] "  # before a line whose start lies beyond MAX_LOG_BYTES
_BLOCK = 64 * 1024
_NEWLINE = re.compile(rb"\r\n|\r|\n")  # universal newlines, as text mode splits them (progress bars use \r)
MAX_POINTS = 2000  # per series and request: a day of 1 Hz samples is thinned for the first load
# Seconds a connection may stay silent (request head, or idle between requests) before it
# is closed: http.server waits forever by default, and each open connection holds a thread
# (300 half-sent requests held 300 threads and 3.5 GB of address space; 800 hung the server).
CLIENT_TIMEOUT_S = 10.0


def plotly_js() -> Path:
    """plotly.min.js as shipped inside the plotly wheel (found without importing plotly)."""
    require("dashboard", "dtrain dashboard")
    spec = importlib.util.find_spec("plotly")
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise DtrainError(f"plotly.min.js not found at {path}", "reinstall plotly: pip install --force-reinstall plotly")
    return path


def _thin(columns: dict[str, list]) -> dict[str, list]:
    """Every k-th sample so that at most MAX_POINTS remain (the newest is always kept)."""
    n = len(columns["t"])
    if n <= MAX_POINTS:
        return columns
    keep = list(range(n - 1, -1, -math.ceil(n / MAX_POINTS)))[::-1]
    return {c: [v[i] for i in keep] for c, v in columns.items()}


def _job(job_id: str) -> JobInfo:
    """Only jobs the page lists: an id from a URL never becomes a path."""
    for info in list_jobs():
        if info.id == job_id:
            return info
    raise DtrainError(f"no job {job_id!r} with stored metrics")


def series(job_id: str, since: float) -> dict[str, Any]:
    info = _job(job_id)
    store = info.open()
    try:
        end = info.end(store)
        span = store.time_range()
        nodes = {}
        for node, cols in store.node_series(since).items():
            cols.pop("detail", None)
            nodes[node] = _thin(cols)
        return {
            "job": info.as_dict(),
            "last": span[1] if span else since,
            "first": span[0] if span else None,
            "states": rules.node_states(store.nodes(), end),
            "nodes": nodes,
            "gpus": {f"{n}/gpu{g}": _thin(s) for (n, g), s in store.gpu_series(since).items()},
            "ranks": {f"{r}": dict(_thin(s), node=n) for (n, r), s in store.rank_series(since).items()},
            "findings": [f.as_dict() for f in rules.from_store(store, end)],
            "cost": job_cost(info.nodes, info.started, info.ended),  # None off rented clusters
        }  # fmt: skip
    finally:
        store.close()


def logs(job_id: str, lines: int) -> dict[str, list[str]]:
    info = _job(job_id)
    files = sorted((info.dir / "logs").glob("*.log")) + [info.dir / "monitor.log"]
    return {path.stem if path.parent.name == "logs" else "monitor": tail(path, lines) for path in files
            if path.is_file()}  # fmt: skip


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a log, from at most its last MAX_LOG_BYTES, each cut to
    MAX_LOG_LINE characters (marked LINE_CUT; a first line whose start was not read is
    marked START_CUT)."""
    with open(path, "rb") as fh:
        data, whole = _end_of(fh, lines)
    parts = _NEWLINE.split(data)
    if parts[-1] == b"":
        parts.pop()  # the file ends with a newline: no line after it
    first = max(0, len(parts) - lines)
    return [_shown(raw, start_cut=i == 0 and not whole) for i, raw in enumerate(parts[first:], first)]


def _end_of(fh: BinaryIO, lines: int) -> tuple[bytes, bool]:
    """The end of an open file back to the newline before its last `lines` lines, or
    MAX_LOG_BYTES of it, whichever is shorter; True when that is the whole file."""
    end = fh.seek(0, os.SEEK_END)
    start, data = end, b""
    while start > 0 and end - start < MAX_LOG_BYTES and len(_NEWLINE.findall(data)) <= lines:
        step = min(_BLOCK, start, MAX_LOG_BYTES - (end - start))
        start -= step
        fh.seek(start)
        data = fh.read(step) + data
    return data, start == 0


def _shown(raw: bytes, start_cut: bool) -> str:
    text = raw.decode("utf-8", errors="replace")
    if len(text) > MAX_LOG_LINE:
        text = text[:MAX_LOG_LINE] + LINE_CUT
    return START_CUT + text if start_cut else text


def _static(name: str) -> Path | None:
    """Only files shipped in static/: a name from the URL never leaves that folder."""
    path = (STATIC / name).resolve()
    return path if path.parent == STATIC.resolve() else None


class _Handler(BaseHTTPRequestHandler):
    def setup(self) -> None:
        # StreamRequestHandler.setup applies `timeout` to the socket; on expiry
        # handle_one_request closes the connection and the thread ends.
        self.timeout = self.server.client_timeout_s
        super().setup()

    def do_GET(self) -> None:  # noqa: N802
        self._answering = False
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/") if p]
        try:
            if not parts:
                self._file(STATIC / "index.html")
            elif parts[0] == "static" and len(parts) == 2:
                self._file(plotly_js() if parts[1] == "plotly.min.js" else _static(parts[1]))
            elif parts == ["api", "jobs"]:
                self._json([j.as_dict() for j in list_jobs()])
            elif len(parts) == 4 and parts[:2] == ["api", "jobs"] and parts[3] == "series":
                self._json(series(parts[2], float(query.get("since", ["0"])[0])))
            elif len(parts) == 4 and parts[:2] == ["api", "jobs"] and parts[3] == "logs":
                n = min(MAX_LOG_LINES, int(query.get("lines", ["50"])[0]))
                self._json(logs(parts[2], n))
            else:
                self._send(404, b"not found\n", "text/plain")
        except DtrainError as exc:
            self._send(404, json.dumps({"error": str(exc)}).encode(), "application/json")
        except ValueError as exc:
            self._send(400, json.dumps({"error": str(exc)}).encode(), "application/json")
        except Exception as exc:  # noqa: BLE001 - a bug or a damaged store: say so, keep serving
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """A 500 naming an unexpected error: unanswered, the client saw the connection
        closed with no reason (an empty reply) and the server's log held a traceback."""
        self.close_connection = True
        if self._answering:  # the answer had begun (the client went away or stopped reading)
            return
        message = f"{type(exc).__name__}: {exc}"
        sys.stderr.write(f"dtrain dashboard: GET {self.path} failed: {message}\n")
        self._send(500, json.dumps({"error": message}).encode(), "application/json")

    def _file(self, path: Path | None) -> None:
        if path is None or not path.is_file():
            self._send(404, b"not found\n", "text/plain")
            return
        body = path.read_bytes()
        self._send(200, body, TYPES.get(path.suffix, "application/octet-stream"), cache=path.name == "plotly.min.js")

    def _json(self, obj: Any) -> None:
        self._send(200, json.dumps(obj).encode(), "application/json")

    def _send(self, code: int, body: bytes, ctype: str, cache: bool = False) -> None:
        self._answering = True
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=86400" if cache else "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # the page polls every 2 s
        pass


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True
    client_timeout_s = CLIENT_TIMEOUT_S


class _DashboardServer6(DashboardServer):
    address_family = socket.AF_INET6


def make_server(host: str = "127.0.0.1", port: int = 8765) -> DashboardServer:
    plotly_js()  # fail at start, not on the first page load
    cls = _DashboardServer6 if ":" in host else DashboardServer
    return cls((host, port), _Handler)
