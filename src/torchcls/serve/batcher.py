"""Dynamic batching: requests from the event loop are packed into batches that one worker thread runs.

The queue is bounded in images: `submit` refuses (QueueFull) instead of growing without
limit, and every job it accepted is answered, also during shutdown (`close` drains).

Results leave the worker thread as numpy arrays, softmax and top-1 computed once per batch:
a torch call on the event loop releases the GIL and must take it back from the model thread
(the one in each request's answer cost ~0.15 ms of the loop's time under load). A batch's
results reach the event loop in one wake-up (one call_soon_threadsafe per loop, not one per request):
each wake-up is a write to the loop's self-pipe and a pass through the loop, both holding the GIL
that the model thread needs between its operators.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("torchcls.serve")


class QueueFull(Exception):
    """The bounded queue cannot take this request now (answered with 503)."""


@dataclass
class Result:
    logits: np.ndarray  # (n, classes) float32
    probs: np.ndarray  # (n, classes) float32
    top1: np.ndarray  # (n,) int64: index of the largest logit
    batch_size: int  # size of the batch this request ran in


@dataclass
class _Job:
    x: torch.Tensor
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _deliver(future: asyncio.Future, value: object, error: bool) -> None:
    if not future.done():  # the client may have gone away and its request been cancelled
        (future.set_exception if error else future.set_result)(value)


def _deliver_all(answers: list[tuple[asyncio.Future, object]]) -> None:
    for future, result in answers:
        _deliver(future, result, False)


class DynamicBatcher:
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], max_batch: int, max_wait_s: float,
                 max_queue: int, on_batch: Callable[[int, float], None] = lambda n, s: None,
                 on_depth: Callable[[int], None] = lambda n: None, multilabel: bool = False):
        self.fn, self.max_batch, self.max_wait_s, self.max_queue = fn, max_batch, max_wait_s, max_queue
        self.multilabel = multilabel  # probabilities: one sigmoid per class instead of a softmax
        self.on_batch, self.on_depth = on_batch, on_depth
        self.ready = threading.Event()
        self.warmup_error: BaseException | None = None
        self._jobs: collections.deque[_Job] = collections.deque()
        self._pending = 0  # images accepted and not yet running
        self._closing = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self, warmup: list[torch.Tensor], on_ready: Callable[[BaseException | None], None]) -> None:
        """Start the worker: it runs the warm-up inputs, then marks itself ready and serves jobs."""
        self._thread = threading.Thread(target=self._main, args=(warmup, on_ready), name="batcher", daemon=True)
        self._thread.start()

    def check_room(self, n: int) -> None:
        """Raise QueueFull now when n more images would not fit: callers check before paying for decoding."""
        with self._cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if self._pending + n > self.max_queue:
                raise QueueFull(f"the queue is full ({self._pending} of {self.max_queue} images waiting); "
                                "retry later")

    async def submit(self, x: torch.Tensor) -> Result:
        loop = asyncio.get_running_loop()
        job = _Job(x, loop.create_future(), loop)
        n = x.shape[0]
        with self._cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if self._pending + n > self.max_queue:
                raise QueueFull(f"the queue is full ({self._pending} of {self.max_queue} images waiting); "
                                "retry later")
            self._jobs.append(job)
            self._pending += n
            self.on_depth(self._pending)
            self._cond.notify()
        return await job.future

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, run every accepted one, stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self, warmup: list[torch.Tensor], on_ready: Callable[[BaseException | None], None]) -> None:
        try:
            for x in warmup:
                self.fn(x)
        except BaseException as e:  # noqa: BLE001 - reported to the server, which stops with a message
            self.warmup_error = e
            on_ready(e)
            return
        self.ready.set()
        on_ready(None)
        while (jobs := self._collect()) is not None:
            self._run(jobs)

    def _collect(self) -> list[_Job] | None:
        with self._cond:
            while not self._jobs and not self._closing:
                self._cond.wait()
            if not self._jobs:
                return None  # closing and drained
            # Wait a little for more work: a fuller batch costs about as much as a small one.
            deadline = time.monotonic() + self.max_wait_s
            while self._pending < self.max_batch and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    break
            jobs = [self._jobs.popleft()]
            size = jobs[0].x.shape[0]
            while self._jobs and size + self._jobs[0].x.shape[0] <= self.max_batch:
                jobs.append(self._jobs.popleft())
                size += jobs[-1].x.shape[0]
            self._pending -= size
            self.on_depth(self._pending)
            return jobs

    def _run(self, jobs: list[_Job]) -> None:
        start = time.perf_counter()
        try:
            x = jobs[0].x if len(jobs) == 1 else torch.cat([j.x for j in jobs])
            out = self.fn(x)
            probs = out.sigmoid() if self.multilabel else out.softmax(dim=1)
            logits, probs, top1 = out.numpy(), probs.numpy(), out.argmax(dim=1).numpy()
        except BaseException as e:  # noqa: BLE001 - handed to every request of the batch
            for j in jobs:
                j.loop.call_soon_threadsafe(_deliver, j.future, e, True)
            return
        n = x.shape[0]
        self.on_batch(n, time.perf_counter() - start)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Result]]] = {}
        offset = 0
        for j in jobs:
            k = j.x.shape[0]
            result = Result(logits[offset:offset + k], probs[offset:offset + k], top1[offset:offset + k], n)
            by_loop.setdefault(j.loop, []).append((j.future, result))
            offset += k
        for loop, answers in by_loop.items():
            loop.call_soon_threadsafe(_deliver_all, answers)
