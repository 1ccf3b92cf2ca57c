"""MicroBatcher on its own: batching across concurrent submitters, order, failures."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from dtrain.serve.batching import MicroBatcher


def _run(coro):
    return asyncio.run(coro)


def test_concurrent_submits_share_batches_and_get_their_own_results():
    sizes, threads = [], set()

    def predict(images: np.ndarray) -> list[int]:
        sizes.append(len(images))
        threads.add(threading.get_ident())
        time.sleep(0.01)  # inference takes a while: more requests queue up meanwhile
        return [int(x[0, 0, 0]) * 10 for x in images]

    async def main():
        batcher = MicroBatcher(predict, max_batch=8, max_wait_s=0.005)
        await batcher.start()
        try:
            images = [np.full((3, 2, 2), i, np.uint8) for i in range(50)]
            return await asyncio.gather(*(batcher.submit(x) for x in images))
        finally:
            await batcher.stop()

    results = _run(main())
    assert results == [i * 10 for i in range(50)]
    assert sum(sizes) == 50 and max(sizes) <= 8 and len(sizes) < 50
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_a_failing_batch_fails_its_requests_only():
    calls = []

    def predict(images):
        calls.append(len(images))
        if len(calls) == 1:
            raise RuntimeError("backend fell over")
        return [1] * len(images)

    async def main():
        batcher = MicroBatcher(predict, max_batch=4, max_wait_s=0.0)
        await batcher.start()
        with pytest.raises(RuntimeError, match="fell over"):
            await batcher.submit(np.zeros((3, 2, 2), np.uint8))
        ok = await batcher.submit(np.zeros((3, 2, 2), np.uint8))
        await batcher.stop()
        return ok

    assert _run(main()) == 1


def test_images_that_do_not_stack_fail_their_batch_and_the_batcher_goes_on():
    """Issue 10: np.stack raised outside the batch's try, the collector task died, and
    every later request hung."""

    async def main():
        batcher = MicroBatcher(lambda images: [int(x.sum()) for x in images], max_batch=8, max_wait_s=0.05)
        await batcher.start()
        try:
            odd = await asyncio.wait_for(asyncio.gather(
                batcher.submit(np.ones((3, 2, 2), np.uint8)), batcher.submit(np.ones((5, 3, 2, 2), np.uint8)),
                return_exceptions=True), timeout=10)
            later = await asyncio.wait_for(batcher.submit(np.ones((3, 2, 2), np.uint8)), timeout=10)
            return odd, later, batcher.dead
        finally:
            await batcher.stop()

    odd, later, dead = _run(main())
    assert all(isinstance(r, ValueError) for r in odd), odd
    assert later == 12 and dead is None
