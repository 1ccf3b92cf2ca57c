"""The service when inference itself fails: a failing batch is a 500 (counted), a stuck
one a 504 (counted), and a dead batching task turns /healthz to 503 instead of leaving
every later request hanging. The real exported model, wrapped to fail on cue."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from tests.serve_hooks import Decodes


class _Failing:
    """A Predictor whose next predict() does `failure` (then it behaves again)."""

    def __init__(self, predictor) -> None:
        self._p = predictor
        self.card, self.backend, self.input_hw = predictor.card, predictor.backend, predictor.input_hw
        self.sample_bits = predictor.sample_bits
        self.failure = None
        self.release = threading.Event()

    def predict(self, images):
        failure, self.failure = self.failure, None
        if failure == "wrong count":
            return self._p.predict(images)[:-1] or [None, None]
        if failure == "hang":
            self.release.wait(30)
        if failure == "die":
            raise asyncio.CancelledError  # not an Exception: it ends the batching task itself
        if failure == "nan":  # a broken export or backend: NaN logits, through the real judging
            import numpy as np

            from dtrain.serve.predictor import judge

            logits = np.full((len(images), len(self.card.classes)), np.nan)
            return judge(logits, self.card.classes, self.card.negative_index, self._p.threshold)
        return self._p.predict(images)


@pytest.fixture
def client(exported_model):
    from dtrain.serve.app import ServeLimits, create_app
    from dtrain.serve.predictor import Predictor

    predictor = _Failing(Predictor(exported_model))
    app = create_app(predictor, ServeLimits(request_timeout_s=1.0))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.predictor = predictor
        yield c
        predictor.release.set()


def _inspect(client, image: bytes):
    return client.post("/inspect", files=[("files", ("part.png", image, "image/png"))])


def _statuses(client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    return {s.labels["status"]: s.value for s in families["dtrain_serve_requests"].samples
            if s.labels.get("path") == "/inspect" and s.name.endswith("_total")}


@pytest.fixture
def image(synth_data) -> bytes:
    return next((synth_data / "test").rglob("*.png")).read_bytes()


def test_a_failing_batch_is_a_counted_500_and_the_next_request_works(client, image):
    client.predictor.failure = "wrong count"
    r = _inspect(client, image)
    assert r.status_code == 500 and "internal error" in r.json()["detail"]
    assert _inspect(client, image).status_code == 200
    assert _statuses(client) == {"500": 1.0, "200": 1.0}


def test_a_stuck_request_is_a_counted_504(client, image):
    client.predictor.failure = "hang"
    start = time.monotonic()
    r = _inspect(client, image)
    assert r.status_code == 504 and "no verdict within 1 s" in r.json()["detail"]
    assert time.monotonic() - start < 20
    client.predictor.release.set()
    assert _inspect(client, image).status_code == 200
    assert _statuses(client) == {"504": 1.0, "200": 1.0}


def test_a_dead_batcher_is_reported_by_healthz_and_fails_requests_fast(client, image):
    assert client.get("/healthz").status_code == 200
    client.predictor.failure = "die"
    assert _inspect(client, image).status_code >= 500
    health = client.get("/healthz")
    assert health.status_code == 503 and "batching task" in health.json()["detail"]
    r = _inspect(client, image)  # at once, not after a timeout
    assert r.status_code == 503 and "restart" in r.json()["detail"]


def test_after_a_504_the_rest_of_the_request_is_not_decoded(exported_model, image, monkeypatch):
    """The decoding thread went on through every image of a request already answered 504."""
    from dtrain.serve.app import ServeLimits, create_app
    from dtrain.serve.predictor import Predictor

    decodes = Decodes(monkeypatch, hold_at=3)
    with TestClient(create_app(Predictor(exported_model), ServeLimits(request_timeout_s=0.2))) as client:
        r = client.post("/inspect", files=[("files", (f"part{i}.png", image, "image/png")) for i in range(40)])
        assert r.status_code == 504
        assert decodes.after_release() == 3  # the image in hand when the 504 went out; not the 37 after it


def test_an_abandoned_request_gives_up_its_wait_for_the_decode_budget():
    from dtrain.serve.images import Abandoned, DecodeBudget

    budget = DecodeBudget(100)
    abandoned, outcome = threading.Event(), []

    def waiting() -> None:
        try:
            with budget.hold(60, abandoned):
                outcome.append("decoded")
        except Abandoned:
            outcome.append("gave up")

    with budget.hold(60):  # a large image of another request decodes meanwhile
        thread = threading.Thread(target=waiting)
        thread.start()
        budget.abandon(abandoned)
        thread.join(30)
        assert outcome == ["gave up"]
    with budget.hold(100):  # and nothing of the budget was kept
        pass


def test_an_image_the_network_scores_as_nan_is_never_passed_as_ok(client, exported_model, synth_data, tmp_path):
    """P(defect) NaN failed "p >= threshold", so the part read "ok" (with a defect class
    beside it) in dtrain inspect's CSV, and the service died on the JSON (a bare 500)."""
    from dtrain.serve.inspect_batch import inspect_paths
    from dtrain.serve.predictor import NOT_A_NUMBER, Predictor, judge

    import numpy as np

    logits = np.array([[np.nan, 1.0], [0.0, 5.0], [np.inf, 0.0], [-5.0, np.inf]])
    got = judge(logits, ["ok", "scratch"], 0, 0.5)
    assert [v.verdict for v in got] == ["", "defect", "", ""] and all(v.error == NOT_A_NUMBER for v in got if not v.verdict)

    image = sorted((synth_data / "test" / "ok").glob("*.png"))[0]
    client.predictor.failure = "nan"
    r = _inspect(client, image.read_bytes())
    assert r.status_code == 500 and "not a number" in r.json()["detail"], r.text

    wrapped = type(client.predictor)(Predictor(exported_model))
    wrapped.failure = "nan"
    rows = list(inspect_paths(wrapped, [image], batch=1, workers=1))
    assert rows[0].verdict == "" and rows[0].error == NOT_A_NUMBER, rows[0]
