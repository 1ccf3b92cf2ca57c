"""Dynamic micro-batching: single images from concurrent requests become one batch.

Requests put (image, future) on an asyncio queue. One collector task takes the first
waiting image, then whatever else arrives within `max_wait_s` (or until `max_batch`),
and hands the stack to a single inference thread. While that thread works, new images
queue up, so under load batches grow by themselves and at low load an image waits at
most `max_wait_s`. Images that queued while the last batch ran go at once, without
waiting for more: under load the wait would only idle the network (bench/serve_load.py).
One inference thread, because the backends already use every core
for one batch; two would only fight over them.

Whatever goes wrong with one batch (a backend error, images that do not stack, a
result count that does not match) fails that batch's requests and nothing else. Should
the collector task end anyway, `dead` says why (the service's /healthz turns 503) and
every waiting request fails at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")
log = logging.getLogger("dtrain.serve")


class MicroBatcher(Generic[T]):
    def __init__(
        self,
        predict: Callable[[np.ndarray], Sequence[T]],
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.005,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._predict = predict
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._on_batch = on_batch
        self._queue: asyncio.Queue[tuple[np.ndarray, asyncio.Future[T]]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = False
        self.dead: str | None = None  # why the collector task ended, when it did

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrain-infer")
        self._task = asyncio.create_task(self._collect(), name="dtrain-batcher")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        self.dead = f"the batching task ended: {exc!r}" if exc else "the batching task was cancelled"
        log.error("inspection service broken: %s", self.dead)
        self._fail_waiting(RuntimeError(self.dead))

    def _fail_waiting(self, exc: Exception) -> None:
        while self._queue is not None and not self._queue.empty():
            _, fut = self._queue.get_nowait()
            if not fut.done():
                fut.set_exception(exc)

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._fail_waiting(RuntimeError("the inspection service is shutting down"))

    async def submit(self, image: np.ndarray) -> T:
        if self._queue is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        if self.dead:
            raise RuntimeError(self.dead)
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        await self._queue.put((image, fut))
        return await fut

    async def submit_many(self, images: Sequence[np.ndarray]) -> list[T]:
        return list(await asyncio.gather(*(self.submit(x) for x in images)))

    async def _collect(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            backlog = not self._queue.empty()  # queued while the last batch ran
            batch = [await self._queue.get()]
            deadline = loop.time() + (0.0 if backlog else self.max_wait_s)
            while len(batch) < self.max_batch:
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    # asyncio.timeout cancels get() before it takes an item, so none is lost.
                    async with asyncio.timeout(remaining):
                        batch.append(await self._queue.get())
                except TimeoutError:
                    break
            batch = [(x, f) for x, f in batch if not f.done()]  # the client went away
            if batch:
                await self._run(loop, batch)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[tuple[np.ndarray, asyncio.Future[T]]]) -> None:
        try:
            images = np.stack([x for x, _ in batch])
            results = list(await loop.run_in_executor(self._executor, self._predict, images))
            if len(results) != len(batch):
                raise RuntimeError(f"the backend returned {len(results)} results for {len(batch)} images")
            if self._on_batch is not None:
                self._on_batch(len(batch))
        except BaseException as exc:  # fails these requests; only a BaseException ends the task too
            failure = exc if isinstance(exc, Exception) else RuntimeError(f"inference interrupted: {exc!r}")
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            log.exception("inference failed for a batch of %d images", len(batch))
            return
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)
