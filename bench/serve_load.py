"""`dtrain serve` under load: N concurrent clients on loopback posting real images.

For each mode (micro-batching on: `--max-batch 32`, the default; off: `--max-batch 1`,
one image per inference call, as a request-at-a-time service would run) a real
`dtrain serve` process is started on an exported model directory; then for each client
count the clients post real images (one per request by default), each waiting for its
answer before the next, for a bounded time and request count; the modes take turns, so
both see the same background load. Reported per (mode, clients): requests/s, images/s,
p50/p99 latency, errors, the mean inference batch (from /metrics), the server's CPU
time per request (less sensitive than requests/s to what else the machine runs) and its
RSS before and after.

    python bench/serve_load.py --model MODEL_DIR --images DIR [--clients 1,4,16,32] [--seconds 10]
    python bench/serve_load.py --model MODEL_DIR --images DIR --quick     # a smoke run (the tests)

The clients (asyncio + httpx, spread over --client-procs processes) run on the same
machine as the server: on a 2-core machine they take CPU from it, the same for both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODES = {"batching": ["--max-batch", "32"], "one-at-a-time": ["--max-batch", "1"]}
WARMUP_REQUESTS = 3
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


@dataclass
class Row:
    mode: str
    clients: int
    requests: int
    images: int
    errors: int
    seconds: float
    requests_per_s: float
    images_per_s: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    server_cpu_ms_per_request: float  # the server process's CPU time (all threads) per answered request
    rss_before_mb: float
    rss_after_mb: float


class Server:
    """`dtrain serve MODEL --port 0 ARGS` in its own process, up until stop()."""

    def __init__(self, model: Path, args: list[str], log: Path, timeout_s: float = 300.0) -> None:
        self.log = log
        self._fh = open(log, "wb")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen([sys.executable, "-m", "dtrain", "serve", str(model), "--port", "0", *args],
                                     cwd=REPO, stdout=self._fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not (match := re.search(r"on http://127\.0\.0\.1:(\d+)", self._output())):
            self._check_alive(deadline)
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{match.group(1)}"
        while True:  # "serving on" comes once bound; /healthz answers once uvicorn runs
            try:
                if httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            self._check_alive(deadline)
            time.sleep(0.1)

    def _output(self) -> str:
        return self.log.read_text(errors="replace")

    def _check_alive(self, deadline: float) -> None:
        if self.proc.poll() is not None or time.monotonic() > deadline:
            self.stop()
            sys.exit(f"dtrain serve did not come up:\n{self._output()[-3000:]}")

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def batches(self) -> tuple[float, float]:
        """(images, batches) inferred so far, from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = re.search(r"^dtrain_serve_batch_size_sum ([\d.e+]+)$", text, re.M)
        count = re.search(r"^dtrain_serve_batch_size_count ([\d.e+]+)$", text, re.M)
        return float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()


async def _load(url: str, images: list[tuple[str, bytes]], per_request: int, clients: int, seconds: float, max_requests: int):
    """Latencies (s) of the successful requests, the error count and the wall time."""
    latencies: list[float] = []
    errors = 0
    sent = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:
        start = time.perf_counter()
        stop_at = start + seconds

        async def client(k: int) -> None:
            nonlocal errors, sent
            i = k
            while time.perf_counter() < stop_at and sent < max_requests:
                sent += 1
                files = [("files", (name, data, "application/octet-stream"))
                         for name, data in (images[(i + j) % len(images)] for j in range(per_request))]
                i += clients * per_request
                t0 = time.perf_counter()
                try:
                    r = await http.post("/inspect", files=files)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        await asyncio.gather(*(client(k) for k in range(clients)))
        return latencies, errors, time.perf_counter() - start


@dataclass
class Sample:
    """One stretch of load on one server."""

    latencies: list[float]
    errors: int
    wall: float
    inferred: float  # images through the backend
    batches: float  # inference calls
    server_cpu_s: float
    rss_before_mb: float
    rss_after_mb: float


_IMAGES: list[tuple[str, bytes]] = []  # each client process's copy (set by _init)


def _init(images: list[tuple[str, bytes]]) -> None:
    _IMAGES[:] = images


def _load_part(job: tuple[str, int, int, float, int]):
    url, per_request, clients, seconds, max_requests = job
    return asyncio.run(_load(url, _IMAGES, per_request, clients, seconds, max_requests))


def sample(server: Server, pool: ProcessPoolExecutor, procs: int, clients: int, per_request: int, seconds: float,
           max_requests: int) -> Sample:
    """`clients` clients spread over `procs` processes: one Python process cannot prepare
    and read HTTP requests fast enough for 32 clients, and a client that lags turns the
    load into bursts."""
    rss_before, cpu_before = server.rss_mb(), server.cpu_s()
    inferred_before, batches_before = server.batches()
    shares = [clients // procs + (i < clients % procs) for i in range(min(procs, clients))]
    jobs = [(server.url, per_request, n, seconds, max(1, max_requests * n // clients)) for n in shares]
    parts = list(pool.map(_load_part, jobs))
    latencies = [x for part in parts for x in part[0]]
    errors, wall = sum(part[1] for part in parts), max(part[2] for part in parts)
    inferred_after, batches_after = server.batches()
    return Sample(latencies, errors, wall, inferred_after - inferred_before, batches_after - batches_before,
                  server.cpu_s() - cpu_before, rss_before, server.rss_mb())


def row(mode: str, clients: int, per_request: int, samples: list[Sample]) -> Row:
    latencies = [x for s in samples for x in s.latencies]
    ms = np.array(latencies) * 1000 if latencies else np.zeros(1)
    wall = sum(s.wall for s in samples)
    batches = sum(s.batches for s in samples)
    return Row(
        mode=mode, clients=clients, requests=len(latencies), images=len(latencies) * per_request,
        errors=sum(s.errors for s in samples), seconds=round(wall, 2), requests_per_s=round(len(latencies) / wall, 2),
        images_per_s=round(len(latencies) * per_request / wall, 2),
        p50_ms=round(float(np.percentile(ms, 50)), 1), p99_ms=round(float(np.percentile(ms, 99)), 1),
        mean_batch=round(sum(s.inferred for s in samples) / batches, 2) if batches else 0.0,
        server_cpu_ms_per_request=round(sum(s.server_cpu_s for s in samples) * 1000 / max(len(latencies), 1), 2),
        rss_before_mb=round(samples[0].rss_before_mb, 1), rss_after_mb=round(samples[-1].rss_after_mb, 1),
    )


def read_images(folder: Path, limit: int) -> list[tuple[str, bytes]]:
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    if not paths:
        sys.exit(f"no images under {folder}")
    return [(p.name, p.read_bytes()) for p in paths]


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="a model directory from dtrain export")
    ap.add_argument("--images", required=True, type=Path, help="a folder of real images (searched recursively)")
    ap.add_argument("--clients", default="1,4,16,32", help="comma-separated concurrent client counts")
    ap.add_argument("--images-per-request", type=int, default=1, help="images posted in each request")
    ap.add_argument("--seconds", type=float, default=10.0, help="load time per (mode, clients)")
    ap.add_argument("--rounds", type=int, default=3, help="turns each mode takes per client count (seconds split among them)")
    ap.add_argument("--max-requests", type=int, default=20000, help="requests per (mode, clients) at most")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--serve-args", default="", help="extra `dtrain serve` options for both modes")
    ap.add_argument("--client-procs", type=int, default=4, help="processes the clients are spread over")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 4 clients, 1 s each")
    args = ap.parse_args(argv)
    clients = [1, 4] if args.quick else [int(c) for c in args.clients.split(",")]
    seconds = 1.0 if args.quick else args.seconds
    rounds = 1 if args.quick else args.rounds
    images = read_images(args.images, 64 if args.quick else 1024)

    modes = args.modes.split(",")
    per_request = args.images_per_request
    rows: list[Row] = []
    procs = max(1, args.client_procs)
    with tempfile.TemporaryDirectory(prefix="dtrain-serve-load-") as tmp, \
            ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"), initializer=_init,
                                initargs=(images,)) as pool:
        servers: dict[str, Server] = {}
        try:
            for mode in modes:
                servers[mode] = Server(args.model, MODES[mode] + args.serve_args.split(), Path(tmp) / f"{mode}.log")
                # Uncounted: the first requests pay for lazy imports and the backend's first run.
                sample(servers[mode], pool, procs, 1, per_request, 60.0, WARMUP_REQUESTS)
            for n in clients:
                # The modes take turns, `rounds` times, so that a change in the machine's
                # other load falls on both alike.
                samples: dict[str, list[Sample]] = {m: [] for m in modes}
                for _ in range(rounds):
                    for mode in modes:
                        samples[mode].append(sample(servers[mode], pool, procs, n, per_request, seconds / rounds,
                                                    args.max_requests))
                for mode in modes:
                    rows.append(row(mode, n, per_request, samples[mode]))
                    print(_line(rows[-1]), flush=True)
        finally:
            for server in servers.values():
                server.stop()
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    print(_table(rows))
    return rows


def _line(r: Row) -> str:
    return (f"{r.mode:>14} {r.clients:>3} clients: {r.requests_per_s:7.1f} req/s, p50 {r.p50_ms:7.1f} ms, "
            f"p99 {r.p99_ms:7.1f} ms, mean batch {r.mean_batch:5.2f}, server CPU {r.server_cpu_ms_per_request:5.2f} ms/request, "
            f"{r.errors} errors, "
            f"RSS {r.rss_before_mb:.0f} -> {r.rss_after_mb:.0f} MB")


def _table(rows: list[Row]) -> str:
    head = ("| mode | clients | requests/s | images/s | p50 ms | p99 ms | mean batch | server CPU ms/request | errors "
            "| RSS before -> after MB |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    body = [f"| {r.mode} | {r.clients} | {r.requests_per_s:.1f} | {r.images_per_s:.1f} | {r.p50_ms:.1f} | "
            f"{r.p99_ms:.1f} | {r.mean_batch:.2f} | {r.server_cpu_ms_per_request:.2f} | {r.errors} | {r.rss_before_mb:.0f} -> {r.rss_after_mb:.0f} |" for r in rows]
    return "\n".join([head, *body])


if __name__ == "__main__":
    main()
