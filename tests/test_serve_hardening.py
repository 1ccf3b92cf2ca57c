"""`dtrain serve` as a user runs it (a real process on loopback), against the files of
issue 10: an animated GIF, 16-bit 6000 x 6000 PNGs at once, a taken port, SIGTERM."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.image_fixtures import animated_gif, png16


class Server:
    def __init__(self, model_dir: Path, log: Path, *args: str) -> None:
        self.log = log
        self._fh = open(log, "wb")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen([sys.executable, "-m", "dtrain", "serve", str(model_dir), "--port", "0", *args],
                                     cwd=REPO, stdout=self._fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (match := re.search(r" on (http://\S+) \(backend", self.output())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.1)
        self.url = match.group(1)
        while True:  # printed once bound; answering once the model is loaded and uvicorn runs
            try:
                if httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.1)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def peak_rss_bytes(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._fh.close()


def _post(url: str, *files: tuple[str, bytes], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/inspect", files=[("files", (name, data, "application/octet-stream")) for name, data in files],
                      timeout=timeout)


@pytest.fixture
def good_images(synth_data) -> list[tuple[str, bytes]]:
    return [(p.name, p.read_bytes()) for p in sorted((synth_data / "test").rglob("*.png"))[:3]]


def test_an_animated_gif_gets_a_422_and_the_service_keeps_answering(exported_model, good_images, tmp_path):
    server = Server(exported_model, tmp_path / "serve.log")
    try:
        r = _post(server.url, good_images[0], ("anim.gif", animated_gif()), good_images[1])
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith("anim.gif: GIF of several frames")
        # Concurrent clients, as on a line: every one of the next 100 gets its verdicts.
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _post(server.url, *good_images[: 1 + i % 3], timeout=60), range(100)))
        assert [a.status_code for a in answers] == [200] * 100
        assert all(len(a.json()["results"]) == 1 + i % 3 for i, a in enumerate(answers))
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        # SIGTERM ends it (uvicorn shuts down, then re-raises the signal it caught).
        assert server.stop() in (0, -signal.SIGTERM)
    finally:
        server.stop()


@pytest.mark.slow
def test_sixteen_concurrent_16_bit_6000px_uploads_stay_under_2_gb(exported_model, tmp_path):
    """6000 x 6000 = 36 MP is within the pixel limit. At 16 bits RGB a decode needs 216 MB
    (refused by the default 160 MB), RGBA 288 MB. With the limit raised to 250 MB the
    grey and RGB ones are decoded, taking turns in the default 320 MB budget, and the
    RGBA ones refused: the server's peak RSS (VmHWM, read by the kernel) stays under 2 GB
    either way (4 GB without the budget, measured). The request timeout is raised: the
    answers, not their speed on a loaded machine, are tested."""
    files = {ch: png16(6000, 6000, ch) for ch in (1, 3, 4)}
    uploads = [(f"part{i}-{ch}ch.png", files[ch]) for i, ch in enumerate([1, 3, 4, 3] * 4)]
    for n, (args, expect) in enumerate((([], {1: 413, 3: 413, 4: 413}),
                                        (["--max-decode-mb", "250"], {1: 200, 3: 200, 4: 413}))):
        args = [*args, "--request-timeout-s", "600"]
        server = Server(exported_model, tmp_path / f"serve-{n}.log", *args)
        try:
            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(lambda f: _post(server.url, f, timeout=300), uploads))
            for (name, _), answer in zip(uploads, answers, strict=True):
                channels = int(name.split("-")[1][0])
                assert answer.status_code == expect[channels], (name, answer.text)
                if answer.status_code == 413:
                    assert "refused before decoding" in answer.json()["detail"]
                else:
                    assert answer.json()["results"][0]["verdict"] in ("ok", "defect")
            peak = server.peak_rss_bytes()
            assert peak < 2 * 1024**3, f"peak RSS {peak / 2**30:.2f} GB with {args}"
        finally:
            server.stop()


def test_a_taken_port_is_one_line_and_no_serving_message(exported_model, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "dtrain", "serve", str(exported_model), "--port", str(port)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "serving" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_ipv6_address_is_printed_in_a_url_that_works(exported_model, tmp_path):
    """`--host ::1` printed http://::1:PORT, which no browser or client reads as a URL."""
    server = Server(exported_model, tmp_path / "serve.log", "--host", "::1")
    try:
        assert server.url.startswith("http://[::1]:")  # and /healthz answered there
    finally:
        server.stop()


def test_no_docs_page_loads_assets_from_a_cdn(exported_model, tmp_path):
    server = Server(exported_model, tmp_path / "serve.log")
    try:
        assert httpx.get(f"{server.url}/docs").status_code == 404
        assert httpx.get(f"{server.url}/redoc").status_code == 404
        assert "/inspect" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
    finally:
        server.stop()



def test_the_decode_budget_lets_small_images_share_it_and_large_ones_take_turns():
    import threading

    from dtrain.serve.images import DecodeBudget

    budget = DecodeBudget(100)
    held: list[int] = []
    most = {"bytes": 0, "holders": 0}
    lock = threading.Lock()
    everyone_in = threading.Barrier(5, timeout=30)  # five 10-byte holders fit at once

    def decode(nbytes: int, meet: bool) -> None:
        with budget.hold(nbytes):
            with lock:
                held.append(nbytes)
                most.update(bytes=max(most["bytes"], sum(held)), holders=max(most["holders"], len(held)))
            if meet:
                everyone_in.wait()
            time.sleep(0.02)
            with lock:
                held.remove(nbytes)

    for sizes, meet in (([10] * 5, True), ([60] * 4, False)):
        threads = [threading.Thread(target=decode, args=(n, meet)) for n in sizes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert most["holders"] == 5 and most["bytes"] <= 100  # the 60s never overlapped


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (b"" for a bare close)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_slow_clients_are_cut_off_and_the_service_keeps_answering(exported_model, good_images, tmp_path):
    """A client that connects and says nothing, or sends half a request head, or stalls in
    its upload, held its connection (a socket, a descriptor, the upload's spooled parts) for
    good; a thousand of them (`ulimit -n` 1024) left the service answering nobody."""
    server = Server(exported_model, tmp_path / "serve.log", "--client-timeout-s", "1")
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    try:
        silent = socket.create_connection((host, int(port)), timeout=30)
        half_head = socket.create_connection((host, int(port)), timeout=30)
        half_head.sendall(b"POST /inspect HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; bo")
        stalled = socket.create_connection((host, int(port)), timeout=30)
        stalled.sendall(b"POST /inspect HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                        b"Content-Length: 100000\r\n\r\n--b\r\nContent-Disposition: form-data; name=\"files\"; "
                        b"filename=\"a.png\"\r\n\r\n" + b"\x00" * 1000)
        assert _answer(silent) == b""  # closed; a socket timeout (30 s) would raise here
        assert _answer(half_head) == b""
        stalled_answer = _answer(stalled)
        assert stalled_answer.startswith(b"HTTP/1.1 408"), stalled_answer[:300]
        assert b"the upload stalled: nothing received for 1 s" in stalled_answer
        # A client that takes its time between requests on a kept-alive connection is no
        # slow client: its next request is answered.
        with httpx.Client(timeout=60) as client:
            assert client.get(f"{server.url}/healthz").status_code == 200
            time.sleep(0.5)
            r = client.post(f"{server.url}/inspect", files=[("files", good_images[0])])
            assert r.status_code == 200, r.text
    finally:
        for s in ("silent", "half_head", "stalled"):
            if s in locals():
                locals()[s].close()
        server.stop()
