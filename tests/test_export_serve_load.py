"""bench/serve_load.py --quick: real `dtrain serve` processes, real concurrent clients.
Behaviour only (every request answered, batching visible in the batch sizes), no timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_serve_load_quick_runs_both_modes(exported_model, synth_data, tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "serve_load.py"), "--quick", "--model", str(exported_model),
         "--images", str(synth_data / "test"), "--images-per-request", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["clients"]) for r in rows] == [
        ("batching", 1), ("one-at-a-time", 1), ("batching", 4), ("one-at-a-time", 4)]
    for r in rows:
        assert r["requests"] > 0 and r["errors"] == 0
        assert r["images"] == 2 * r["requests"] and r["images_per_s"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["rss_before_mb"] > 0 and r["rss_after_mb"] > 0
        assert r["mean_batch"] >= 1.0 and r["server_cpu_ms_per_request"] > 0
    one = {r["clients"]: r for r in rows if r["mode"] == "one-at-a-time"}
    assert one[1]["mean_batch"] == one[4]["mean_batch"] == 1.0  # --max-batch 1: one image per inference call
    # Two images per request reach the batcher together: batching joins them.
    assert {r["clients"]: r for r in rows if r["mode"] == "batching"}[4]["mean_batch"] > 1.0
    assert "| mode | clients | requests/s |" in proc.stdout


def test_images_queued_during_a_batch_go_next_without_waiting():
    """Under load the batcher does not idle the network for `max_wait_s`: what queued
    while a batch ran is the next batch. (Before: it waited the full max_wait_s, here 60 s,
    for batch mates that never came.)"""
    import asyncio
    import threading

    import numpy as np

    from dtrain.serve.batching import MicroBatcher

    release, sizes = threading.Event(), []

    def predict(images):
        sizes.append(len(images))
        release.wait(30)
        return [int(x[0, 0, 0]) for x in images]

    async def main():
        batcher = MicroBatcher(predict, max_batch=4, max_wait_s=60.0)
        await batcher.start()
        try:
            first = [asyncio.ensure_future(batcher.submit(np.full((3, 2, 2), i, np.uint8))) for i in range(4)]
            while not sizes:  # a full first batch runs at once
                await asyncio.sleep(0.01)
            later = [asyncio.ensure_future(batcher.submit(np.full((3, 2, 2), i, np.uint8))) for i in (4, 5, 6)]
            await asyncio.sleep(0.05)
            release.set()
            return await asyncio.wait_for(asyncio.gather(*first, *later), timeout=20)
        finally:
            await batcher.stop()

    assert asyncio.run(main()) == list(range(7))
    assert sizes == [4, 3]


def test_served_connections_send_without_nagle():
    """dtrain serve's accepted connections have TCP_NODELAY. Without it each request after
    the first on a keep-alive connection waited 40 ms for the client's delayed ACK (asyncio
    sets the option only for sockets whose protocol number reads IPPROTO_TCP, and
    socket.create_server leaves it 0)."""
    import socket

    from dtrain.serve.listen import listen

    server = listen("127.0.0.1", 0)
    client = socket.create_connection(server.getsockname()[:2])
    conn, _ = server.accept()
    try:
        assert conn.proto != socket.IPPROTO_TCP  # so asyncio would not set the option itself
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        for s in (conn, client, server):
            s.close()
