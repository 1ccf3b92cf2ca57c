"""The HTTP inspection service (FastAPI): POST /inspect, /healthz, /metrics, /openapi.json.

Untrusted input is checked in order of cost: the request body size (before it is
read), each image's pixel count and decode memory from its header (before it is
decoded), then the decode itself; a refusal is a 413 or a 422 with a message, and the
service goes on. Decoding runs in worker threads within a shared budget of decoded
bytes (`decode_budget_bytes`, see images.DecodeBudget: memory stays bounded however
many clients upload at once); inference in the micro-batcher's single thread. A request that takes longer
than `request_timeout_s` gets a 504; every answer, 500s included, is counted in /metrics. A
request answered with a 504, or whose client left (counted as a 499), has no more of its
images decoded.

There is no /docs page: FastAPI's loads Swagger UI from a CDN, which an inspection PC
cannot reach, and no installed package ships its assets. /openapi.json describes the API.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, File, HTTPException, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from dtrain import __version__
from dtrain.configio import StrictModel
from dtrain.serve.batching import MicroBatcher
from dtrain.serve.images import (
    DEFAULT_MAX_DECODE_BYTES,
    DEFAULT_MAX_PIXELS,
    Abandoned,
    DecodeBudget,
    ImageRejected,
    prepare_bytes,
)

log = logging.getLogger("dtrain.serve")
T = TypeVar("T")


class ServeLimits(StrictModel):
    max_batch: int = Field(32, ge=1)
    # 0: an image reaching an idle network goes alone; under load, batches form while the
    # network runs anyway, and waiting only idled it (bench/serve_load.py, BENCHMARKS.md).
    max_wait_ms: float = Field(0.0, ge=0.0)
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1)
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1)
    max_images_per_request: int = Field(256, ge=1)
    max_decode_bytes: int = Field(DEFAULT_MAX_DECODE_BYTES, ge=1)
    # Decoded pixels in flight, all requests together: two of the largest images at once.
    decode_budget_bytes: int = Field(2 * DEFAULT_MAX_DECODE_BYTES, ge=1)
    request_timeout_s: float = Field(60.0, gt=0.0)
    # The longest a client may take over its request head, or stay silent within its upload
    # (slow_clients.py): a LAN client sends both in milliseconds.
    client_timeout_s: float = Field(10.0, gt=0.0)


class ImageVerdict(BaseModel):
    filename: str
    verdict: str = Field(description='"ok" or "defect"')
    class_: str = Field(alias="class", description="the negative class for ok, else the most likely defect class")
    p_defect: float = Field(description="1 - P(negative class)")


class InspectResponse(BaseModel):
    results: list[ImageVerdict]
    threshold: float
    backend: str


class ErrorBody(BaseModel):
    detail: str


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, by Content-Length up front or
    by counting as it streams in (chunked uploads have no length); 408 for an upload that
    sends nothing for `idle_s` (slow_clients.py: a stalled client held its socket, a file
    descriptor and its spooled parts for good)."""

    def __init__(self, app, max_bytes: int, idle_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.idle_s = idle_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body over the limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await JSONResponse({"detail": message}, status_code=413)(scope, receive, send)
        seen = 0
        body_done = False

        async def counted():
            nonlocal seen, body_done
            if body_done or self.idle_s is None:  # after the body: a wait for the disconnect, not timed
                msg = await receive()
            else:
                try:
                    async with asyncio.timeout(self.idle_s):
                        msg = await receive()
                except TimeoutError:
                    raise HTTPException(408, f"the upload stalled: nothing received for {self.idle_s:g} s "
                                             f"after {seen} bytes") from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                body_done = not msg.get("more_body", False)
                if seen > self.max_bytes:
                    # FastAPI re-raises HTTPExceptions from body parsing as they are.
                    raise HTTPException(413, message)
            return msg

        return await self.app(scope, counted, send)


def create_app(predictor, limits: ServeLimits | None = None) -> FastAPI:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    limits = limits or ServeLimits()
    registry = CollectorRegistry()  # per app: several services (tests) in one process
    requests = Counter("dtrain_serve_requests", "HTTP requests by path and status code", ["path", "status"], registry=registry)
    latency = Histogram(
        "dtrain_serve_request_latency_seconds", "Request latency by path", ["path"], registry=registry,
        buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    )
    batch_sizes = Histogram("dtrain_serve_batch_size", "Images per inference batch", registry=registry,
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    verdicts = Counter("dtrain_serve_images", "Images judged, by verdict", ["verdict"], registry=registry)
    batcher: MicroBatcher = MicroBatcher(
        predictor.predict, max_batch=limits.max_batch, max_wait_s=limits.max_wait_ms / 1000.0, on_batch=batch_sizes.observe
    )
    card = predictor.card
    threshold = card.threshold_for(predictor.backend)  # a quantised backend decides at its own
    budget = DecodeBudget(limits.decode_budget_bytes)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(
        title="dtrain inspection service",
        version=__version__,
        description=f"Surface-defect verdicts from the {card.arch} model ({', '.join(card.classes)}); "
        f"a part is a defect when P(defect) >= {threshold:.4f} (backend {predictor.backend}).",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, idle_s=limits.client_timeout_s)

    @app.middleware("http")
    async def measure(request: Request, call_next):
        start = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception as exc:  # a bug, not the client's fault: answered, logged and counted
            log.exception("%s %s failed", request.method, request.url.path)
            response = JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)
        path = request.url.path if request.url.path in ("/inspect", "/healthz", "/metrics") else "other"
        requests.labels(path, str(response.status_code)).inc()
        latency.labels(path).observe(time.perf_counter() - start)
        return response

    refusals = {413: {"model": ErrorBody, "description": "body or image too large"},
                422: {"model": ErrorBody, "description": "not a readable image"},
                503: {"model": ErrorBody, "description": "the service is broken (see /healthz)"},
                504: {"model": ErrorBody, "description": f"no answer within {limits.request_timeout_s:g} s"}}

    @app.post("/inspect", response_model=InspectResponse, response_model_by_alias=True, responses=refusals)
    async def inspect(request: Request,
                      files: list[UploadFile] = File(..., description="one or several image files")) -> InspectResponse:
        """Judge each uploaded image: verdict, class and P(defect)."""
        if len(files) > limits.max_images_per_request:
            raise HTTPException(413, f"{len(files)} images in one request, above the limit of {limits.max_images_per_request}")
        if batcher.dead:
            raise HTTPException(503, f"the inspection service is broken ({batcher.dead}); restart it")
        blobs = [(f.filename or f"image{i}", await f.read()) for i, f in enumerate(files)]
        abandoned = threading.Event()
        try:
            async with asyncio.timeout(limits.request_timeout_s):
                images = await _unless_client_left(request, run_in_threadpool(
                    _prepare_all, blobs, predictor.input_hw, limits, budget, predictor.sample_bits, abandoned))
                results = await batcher.submit_many(images)
        except TimeoutError:
            raise HTTPException(504, f"no verdict within {limits.request_timeout_s:g} s (the service is overloaded "
                                     "or stuck); retry, and check /healthz") from None
        except Abandoned:
            return JSONResponse({"detail": "the client closed the connection"}, status_code=499)  # nginx's code; nobody reads it
        finally:
            # Answered or given up: the decoding thread does not outlive the request by more
            # than the image in hand (it went on through every image after a 504), and its
            # images waiting for the budget leave their turn to other requests.
            budget.abandon(abandoned)
        unjudged = [(name, r.error) for (name, _), r in zip(blobs, results, strict=True) if r.error]
        if unjudged:  # a broken network: no part of the request is passed on as judged
            raise HTTPException(500, f"{', '.join(name for name, _ in unjudged[:5])}: {unjudged[0][1]}")
        for r in results:
            verdicts.labels(r.verdict).inc()
        return InspectResponse(
            results=[ImageVerdict(filename=name, verdict=r.verdict, **{"class": r.cls}, p_defect=r.p_defect)
                     for (name, _), r in zip(blobs, results, strict=True)],
            threshold=threshold,
            backend=predictor.backend,
        )

    @app.get("/healthz", responses={503: {"description": "the batching task died: restart the service"}})
    async def healthz() -> JSONResponse:
        if batcher.dead:
            return JSONResponse({"status": "broken", "detail": batcher.dead}, status_code=503)
        return JSONResponse({"status": "ok", "backend": predictor.backend, "classes": card.classes, "threshold": threshold})

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _prepare_all(blobs: list[tuple[str, bytes]], size: tuple[int, int], limits: ServeLimits, budget: DecodeBudget,
                 sample_bits: int, abandoned: threading.Event):
    out = []
    for name, data in blobs:
        if abandoned.is_set():
            raise Abandoned
        try:
            # The budget is held by this thread, not the request: a request that timed out
            # keeps its share until the decode in hand really ends, so the bound holds.
            out.append(prepare_bytes(data, size, limits.max_pixels, limits.max_decode_bytes, budget, sample_bits,
                                     abandoned))
        except ImageRejected as exc:
            raise HTTPException(exc.status, f"{name}: {exc.message}") from None
    return out


async def _unless_client_left(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or Abandoned as soon as the client disconnects. Starlette goes on
    with a request whose client has left: its images would all be decoded for nobody."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not task.done():  # the client left, or the request timed out (cancelled here)
            task.cancel()
    if not task.done():
        raise Abandoned
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read: what the server receives next is the disconnect (or nothing).
    while (await request.receive())["type"] != "http.disconnect":
        pass
