"""The HTTP service, for real: uvicorn on 127.0.0.1 in a thread, httpx clients."""

from __future__ import annotations

import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow  # end to end: ./dev test -m 'not slow' leaves it out

MAX_BODY = 1_000_000


@pytest.fixture(scope="module")
def service(exported_model):
    import uvicorn

    from dtrain.serve.app import ServeLimits, create_app
    from dtrain.serve.predictor import Predictor

    # A long batching window so that concurrent clients really share batches.
    limits = ServeLimits(max_batch=32, max_wait_ms=20, max_body_bytes=MAX_BODY, max_pixels=4_000_000)
    server = uvicorn.Server(uvicorn.Config(create_app(Predictor(exported_model), limits), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def offline(exported_model, synth_data):
    """Verdicts of the same images by offline `dtrain inspect` (the library path)."""
    from dtrain.serve.inspect_batch import inspect_paths
    from dtrain.serve.predictor import Predictor

    paths = sorted((synth_data / "test").rglob("*.png"))[:48]
    rows = list(inspect_paths(Predictor(exported_model), paths, batch=16, workers=2))
    return {p: r for p, r in zip(paths, rows, strict=True)}


def _post(url, *files):
    return httpx.post(f"{url}/inspect", files=[("files", (name, data, "image/png")) for name, data in files], timeout=120)


def test_concurrent_clients_get_offline_verdicts(service, offline):
    paths = list(offline)
    assert len(paths) >= 32

    def one(path):
        r = _post(service, (path.name, path.read_bytes()))
        assert r.status_code == 200, r.text
        return path, r.json()["results"][0]

    with ThreadPoolExecutor(max_workers=len(paths)) as pool:
        answers = list(pool.map(one, paths))
    for path, got in answers:
        want = offline[path]
        assert got["filename"] == path.name
        assert (got["verdict"], got["class"]) == (want.verdict, want.cls), path
        assert got["p_defect"] == pytest.approx(want.p_defect, abs=1e-5)
    # Dynamic batching happened: fewer inference batches than images.
    metrics = httpx.get(f"{service}/metrics").text
    count = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("dtrain_serve_batch_size_count")]
    total = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("dtrain_serve_batch_size_sum")]
    assert total[0] >= len(paths) and count[0] < total[0]


def test_several_images_in_one_request(service, offline):
    paths = list(offline)[:3]
    r = _post(service, *[(p.name, p.read_bytes()) for p in paths])
    assert r.status_code == 200
    body = r.json()
    assert [x["filename"] for x in body["results"]] == [p.name for p in paths]
    assert [x["verdict"] for x in body["results"]] == [offline[p].verdict for p in paths]
    assert body["backend"] == "ort-fp32" and 0.0 <= body["threshold"] <= 1.0


def test_corrupt_image_gets_422_and_service_keeps_serving(service, offline):
    good = next(iter(offline))
    r = _post(service, ("broken.png", good.read_bytes()[:150]))
    assert r.status_code == 422 and "broken.png" in r.json()["detail"] and "corrupt" in r.json()["detail"]
    r = _post(service, ("text.png", b"hello, not an image"))
    assert r.status_code == 422 and "not an image" in r.json()["detail"]
    assert _post(service, (good.name, good.read_bytes())).status_code == 200


def test_a_header_pillow_chokes_on_gets_422_not_500(service, offline):
    """Pillow's TypeError, KeyError, NotImplementedError on these headers were 500s."""
    from tests.image_fixtures import damaged_files

    for name, data in damaged_files().items():
        r = _post(service, (name, data))
        assert r.status_code == 422 and r.json()["detail"].startswith(f"{name}: "), r.text
    good = next(iter(offline))
    assert _post(service, (good.name, good.read_bytes())).status_code == 200


def test_a_client_that_leaves_stops_the_decoding_of_its_request(service, offline, monkeypatch):
    """Starlette goes on with a request whose client has left: every image was decoded for nobody."""
    from tests.serve_hooks import Decodes

    decodes = Decodes(monkeypatch, hold_at=3)
    good = next(iter(offline)).read_bytes()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the third image is held
        httpx.post(f"{service}/inspect", files=[("files", (f"part{i}.png", good, "image/png")) for i in range(40)],
                   timeout=httpx.Timeout(60, read=0.5))
    deadline = time.monotonic() + 30  # a guard, not a measure: until the service has seen the client go
    while 'status="499"' not in httpx.get(f"{service}/metrics").text:
        assert time.monotonic() < deadline, "the service never noticed the client leave"
        time.sleep(0.05)
    assert decodes.after_release() == 3


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height pixels but carries almost no data: what a
    decompression bomb looks like to a header reader, built without the gigabytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (1 + 3 * width) * 4)  # four rows; decoding would fail on row five
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [20000, 5000])
def test_oversized_image_is_refused_before_decoding(service, offline, side):
    # 20000^2 trips Pillow's own bomb guard inside Image.open; 5000^2 passes it and is
    # refused by the service's limit (4 MP here), read from the header.
    bomb = _png_header(side, side)
    assert len(bomb) < MAX_BODY
    r = _post(service, ("bomb.png", bomb))
    # A 413 (not the 422 a decode of this truncated file would give) shows it was never decoded.
    assert r.status_code == 413, r.text
    assert "bomb.png" in r.json()["detail"] and "before decoding" in r.json()["detail"]
    assert str(side * side) in r.json()["detail"]
    good = next(iter(offline))
    assert _post(service, (good.name, good.read_bytes())).status_code == 200


def test_request_body_limit(service):
    r = _post(service, ("big.png", b"\x00" * (MAX_BODY + 1)))
    assert r.status_code == 413 and "body" in r.json()["detail"]

    def chunked():  # no Content-Length: counted as it streams in
        yield b'--x\r\nContent-Disposition: form-data; name="files"; filename="big.png"\r\nContent-Type: image/png\r\n\r\n'
        for _ in range(3):
            yield b"\x00" * (MAX_BODY // 2)
        yield b"\r\n--x--\r\n"

    r = httpx.post(f"{service}/inspect", content=chunked(), headers={"content-type": "multipart/form-data; boundary=x"},
                   timeout=60)
    assert r.status_code == 413


def test_health_docs_and_metrics(service, offline):
    from prometheus_client.parser import text_string_to_metric_families

    # Its own 200 first: under --dist worksteal the tests that post images may have run on the
    # other worker, whose service this is not (seen once: only the body-limit test's 413 counted).
    good = next(iter(offline))
    assert _post(service, (good.name, good.read_bytes())).status_code == 200
    health = httpx.get(f"{service}/healthz").json()
    assert health["status"] == "ok" and health["backend"] == "ort-fp32"
    schema = httpx.get(f"{service}/openapi.json").json()
    assert "/inspect" in schema["paths"] and "413" in schema["paths"]["/inspect"]["post"]["responses"]
    assert httpx.get(f"{service}/docs").status_code == 404  # Swagger UI would come from a CDN
    text = httpx.get(f"{service}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"dtrain_serve_requests", "dtrain_serve_request_latency_seconds", "dtrain_serve_batch_size"} <= set(families)
    statuses = {s.labels.get("status") for s in families["dtrain_serve_requests"].samples if s.labels.get("path") == "/inspect"}
    assert "200" in statuses
