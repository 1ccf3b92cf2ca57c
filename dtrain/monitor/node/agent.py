"""The node agent: samples the node once per interval, receives per-rank metrics, serves
them to Prometheus (`/metrics`) and to the head collector (`/snapshot`, JSON).

    python -m dtrain.monitor.node.agent --job JOB --node NODE --bind ADDR --port P [--interval 1]

Bound to the node's cluster address (127.0.0.1 unless told otherwise, never 0.0.0.0 by
default). Ranks send report_step datagrams to UDP 127.0.0.1:P (loopback only: no other
host can inject metrics). With --exit-on-stdin-close the agent ends when its stdin
closes, i.e. when the SSH session or the launcher that started it goes away.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dtrain.monitor.node.ranks import RankTable
from dtrain.monitor.node.sampler import NodeSampler

SNAPSHOT_VERSION = 1


class Agent:
    def __init__(self, job: str, node: str, bind: str, port: int, interval: float = 1.0, udp_host: str = "127.0.0.1") -> None:
        self.job, self.node, self.interval = job, node, interval
        self.ranks = RankTable(job)
        self.sampler = NodeSampler(job)
        self.stopping = threading.Event()
        self._host: dict[str, Any] = {}
        self.started = time.time()
        # Port 0 (any free port): the UDP port must match the TCP one the kernel picked,
        # which another program may hold; try a few.
        for attempt in range(5 if port == 0 else 1):
            self.http = _Server((bind, port), _Handler)
            self.port = self.http.server_address[1]
            self.udp = socket.socket(socket.AF_INET6 if ":" in udp_host else socket.AF_INET, socket.SOCK_DGRAM)
            try:
                self.udp.bind((udp_host, self.port))
                break
            except OSError:
                self.udp.close()
                self.http.server_close()
                if attempt == (4 if port == 0 else 0):
                    raise
        self.http.agent = self
        self.udp.settimeout(0.5)

    def snapshot(self) -> dict[str, Any]:
        return {
            "v": SNAPSHOT_VERSION,
            "job": self.job,
            "node": self.node,
            "t": time.time(),
            "started": self.started,
            "interval_s": self.interval,
            "host": self._host,
            "ranks": self.ranks.snapshot(),
        }

    def _receive(self) -> None:
        while not self.stopping.is_set():
            try:
                data = self.udp.recv(65536)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                msg = self.ranks.ingest(data)
                if msg is not None and isinstance(msg.get("pid"), int) and msg["pid"] > 0:
                    self.sampler.procs.add(msg["pid"], int(msg["rank"]))
            except Exception:  # noqa: BLE001 - any process on the node may send a datagram: one must not end the receiving
                self.ranks.bad_datagrams += 1

    def _sample_loop(self) -> None:
        next_t = time.monotonic()
        while not self.stopping.is_set():
            self._host = self.sampler.sample()
            next_t += self.interval
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (suspended, overloaded): do not try to catch up
                next_t, delay = time.monotonic(), 0
            self.stopping.wait(delay)

    def serve(self) -> None:
        """Run until stop(); the first sample is taken before the endpoint answers."""
        self._host = self.sampler.sample()
        threads = [
            threading.Thread(target=self._receive, name="udp", daemon=True),
            threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.5}, name="http", daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            self._sample_loop()
        finally:
            self.http.shutdown()
            self.http.server_close()
            self.udp.close()
            self.sampler.gpus.close()

    def stop(self) -> None:
        self.stopping.set()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    agent: Agent

    def server_bind(self) -> None:
        if ":" in self.server_address[0]:
            self.address_family = socket.AF_INET6
            self.socket = socket.socket(self.address_family, self.socket_type)
        super().server_bind()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # A connection whose request does not arrive in this many seconds is dropped: each holds a
    # thread, and 300 silent ones held 3.5 GB of stacks until their client let go.
    timeout = 10

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        agent = self.server.agent
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            from dtrain.monitor.node.prom import registry_for

            self._send(200, generate_latest(registry_for(agent.snapshot)), CONTENT_TYPE_LATEST)
        elif path == "/snapshot":
            self._send(200, json.dumps(agent.snapshot()).encode(), "application/json")
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        else:
            self._send(404, b"not found: try /metrics or /snapshot\n", "text/plain")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # one line per poll would flood logs
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtrain.monitor.node.agent", description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--bind", default="127.0.0.1", help="address to serve on (the node's cluster address)")
    p.add_argument("--port", type=int, default=9464, help="TCP port for HTTP; the same UDP port on loopback for ranks")
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--exit-on-stdin-close", action="store_true")
    args = p.parse_args(argv)
    try:
        agent = Agent(args.job, args.node, args.bind, args.port, args.interval)
    except OSError as exc:
        print(f"dtrain-agent: error: cannot listen on {args.bind}:{args.port}: {exc}", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: agent.stop())
    if args.exit_on_stdin_close:
        threading.Thread(target=_wait_stdin_eof, args=(agent,), daemon=True).start()
    host = f"[{args.bind}]" if ":" in args.bind else args.bind
    print(f"dtrain-agent {args.node} serving http://{host}:{agent.port}/metrics", flush=True)
    agent.serve()
    return 0


def _wait_stdin_eof(agent: Agent) -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    agent.stop()


if __name__ == "__main__":
    sys.exit(main())
