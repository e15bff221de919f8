"""The dynamic batcher on its own: requests queued while the model is busy run as one batch, each
gets its own rows, and the whole batch reaches the event loop in one wake-up (each wake-up holds
the GIL that the model thread needs)."""

from __future__ import annotations

import asyncio
import threading

import torch

from torchcls.serve.batcher import DynamicBatcher


async def until(condition, patience_s: float = 30.0) -> None:
    """Yield to the loop until `condition` holds (failing after `patience_s`)."""
    deadline = asyncio.get_running_loop().time() + patience_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.001)


class CountingLoop(asyncio.SelectorEventLoop):
    """An ordinary event loop that counts the wake-ups other threads ask of it."""

    wakeups = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def test_requests_queued_while_the_model_is_busy_run_as_one_batch_and_wake_the_loop_once() -> None:
    gate, calls = threading.Event(), []
    weight = torch.randn(12, 5)

    def model(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if len(calls) == 2:  # the first real batch waits until every request below is queued
            gate.wait(10)
        return x.flatten(1) @ weight

    depth = [0]  # the images waiting for the model, as the server's torchcls_queue_depth gauge reports them
    batcher = DynamicBatcher(model, max_batch=16, max_wait_s=0.0, max_queue=64, on_depth=lambda n: depth.__setitem__(0, n))
    ready = threading.Event()
    batcher.start([torch.zeros(1, 3, 2, 2)], lambda e: ready.set())
    assert ready.wait(10)
    loop = CountingLoop()

    async def main():
        first = asyncio.ensure_future(batcher.submit(torch.randn(1, 3, 2, 2)))  # occupies the model
        await until(lambda: len(calls) == 2)
        xs = [torch.randn(1 + i % 2, 3, 2, 2) for i in range(7)]  # 10 images in 7 requests
        tasks = [asyncio.ensure_future(batcher.submit(x)) for x in xs]
        await until(lambda: depth[0] == 10)  # all 7 queued (a count, not a pause)
        before = loop.wakeups
        gate.set()
        results = await asyncio.gather(*tasks)
        await first
        return xs, results, loop.wakeups - before

    try:
        xs, results, wakeups = loop.run_until_complete(main())
    finally:
        batcher.close(5)
        loop.close()
    assert calls == [1, 1, 10]  # warm-up, the busy one, then every queued request together
    assert wakeups == 2  # one for the busy request's batch, one for the batch of seven requests
    for x, r in zip(xs, results):
        expected = x.flatten(1) @ weight
        assert r.batch_size == 10 and r.logits.shape == (x.shape[0], 5)
        torch.testing.assert_close(torch.from_numpy(r.logits), expected)
        torch.testing.assert_close(torch.from_numpy(r.probs), expected.softmax(1))
        assert r.top1.tolist() == expected.argmax(1).tolist()
