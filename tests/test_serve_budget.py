"""serve/limits.py's InflightBudget on its own (no server, no sockets): bodies that arrive at once share the
budget, which never holds more than its limit, and when it is full some of them finish.

Each client is a task sending its body in chunks as fast as the budget lets it (the server's read loop, without
the bytes); a refused body gives its bytes back at once, a complete one when it has been "answered".
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from torchcls.serve.limits import GRACE_S, InflightBudget

MiB = 2**20


class Watched(InflightBudget):
    """The budget, with the most it ever held recorded after every take."""

    peak = 0

    async def take(self, body, n):
        ok = await super().take(body, n)
        self.peak = max(self.peak, self.used)
        return ok


def send_all(budget: InflightBudget, sizes: list[int | None], chunk: int, length: int | None = None):
    """One task per body (`sizes[i]` declared, or None for chunked: then `length` bytes are sent); returns each
    body's fate in admission order: "done", "refused" (mid-body) or "unread" (refused from its headers)."""
    fates: list[str] = [""] * len(sizes)

    async def client(i: int, declared: int | None):
        body = budget.admit(declared)
        if body is None:
            fates[i] = "unread"
            return
        total = declared if declared is not None else length
        try:
            while body.received < total:
                await asyncio.sleep(0)  # another client's chunk may come first
                if not await budget.take(body, min(chunk, total - body.received)):
                    fates[i] = "refused"
                    return
            await asyncio.sleep(0)  # answered a moment later
            fates[i] = "done"
        finally:
            budget.release(body)

    async def main():
        await asyncio.gather(*(client(i, d) for i, d in enumerate(sizes)))

    asyncio.run(main())
    return fates


def test_eight_31_mib_bodies_into_64_mib_the_first_two_finish_and_the_rest_are_refused():
    """What test_serve_limits sends over sockets. Refusing whichever body's chunk did not fit cut all eight."""
    budget = Watched(64 * MiB, 32 * MiB, pace_s=60.0)
    fates = send_all(budget, [31 * MiB] * 8, chunk=64 * 1024)
    assert fates == ["done"] * 2 + ["refused"] * 6
    assert budget.peak <= 64 * MiB and budget.used == 0 and not budget.bodies


def test_declared_sizes_reserve_nothing_a_silent_client_does_not_block_a_body_that_fits():
    """Two clients declare 31 MiB and send nothing (the next attack on a reservation: header-only connections
    holding the budget for free); a third 31 MiB body is read to its end, while the silent ones stay admitted."""

    async def main():
        budget = InflightBudget(64 * MiB, 32 * MiB, pace_s=60.0)
        silent = [budget.admit(31 * MiB) for _ in range(2)]
        third = budget.admit(31 * MiB)
        assert all(silent) and third is not None
        for _ in range(31):
            assert await budget.take(third, MiB)
        assert budget.used == 31 * MiB
        assert not budget.entitled(third)  # behind the two silent ones: waits for nothing, refused when full
        budget.release(third)
        for body in silent:
            budget.release(body)
        assert budget.used == 0

    asyncio.run(main())


def test_a_body_behind_its_pace_is_not_entitled_and_a_chunked_one_counts_as_the_largest_body():
    now = [0.0]
    budget = InflightBudget(64 * MiB, 32 * MiB, pace_s=10.0, clock=lambda: now[0])
    slow, chunked = budget.admit(31 * MiB), budget.admit(None)
    asyncio.run(budget.take(slow, MiB))
    assert budget.entitled(slow) and budget.entitled(chunked)  # 31 + 32 MiB fit 64
    now[0] = 1.0
    later = budget.admit(31 * MiB)
    assert not budget.entitled(later)  # 94 MiB up to its end
    now[0] = GRACE_S + 10.0 * 2 / 31  # `slow`'s pace wants 2 MiB by now (31 MiB in 10 s after the grace); it has 1
    assert not budget.entitled(slow) and not budget.entitled(chunked)  # the chunked one, nothing of 32 MiB
    assert budget.entitled(later)


def test_an_entitled_body_gives_up_after_the_grace_when_the_room_is_not_given_back():
    """The budget is full of a later body's bytes that stay (a stalled client): the first body waits GRACE_S
    for room, then is refused, never holding more than the budget."""

    async def main():
        budget = InflightBudget(4 * MiB, 4 * MiB, pace_s=1e9)
        first, stalled = budget.admit(3 * MiB), budget.admit(3 * MiB)
        assert await budget.take(stalled, 3 * MiB)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert not await budget.take(first, 2 * MiB)
        assert loop.time() - started >= GRACE_S * 0.9 and budget.used == 3 * MiB

    asyncio.run(main())


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.one_of(st.none(), st.integers(1, 2 * MiB)), min_size=1, max_size=10),
       chunk=st.sampled_from([4096, 65536, MiB]))
def test_bodies_sent_at_once_never_exceed_the_budget_and_one_of_them_finishes(sizes, chunk):
    """Any mix of declared and chunked bodies (1 MiB each), each at most half the budget (as the defaults, 32 of
    256 MiB): the budget is never exceeded, is empty at the end, and one of the bodies is read to its end."""
    budget = Watched(4 * MiB, 2 * MiB, pace_s=1e9)
    fates = send_all(budget, sizes, chunk, length=MiB)
    assert budget.peak <= 4 * MiB and budget.used == 0 and not budget.bodies
    assert all(fates) and "done" in fates, (fates, sizes)
