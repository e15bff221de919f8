"""How fast a request body arrives: the minimum body rate of `torchcls serve` (--min-body-rate-kb).

A client that sends its headers and then trickles its body a byte at a time holds a connection slot for
the whole --body-timeout: 1,024 of them answered every real request with 503 for 60 s. The rule, as
Apache's mod_reqtimeout (`body=...,MinRate=...`), is a budget of time: GRACE_S seconds, plus one second
for each `min_rate` bytes received. A body that has used up that budget gets 408 (serve/protocol.py);
at --max-connections a body that is merely *behind* (its average rate since the headers below the
minimum, no grace) is the first to make room for a new connection.

Only the seconds in which the server was asking for bytes count: not while uvicorn has paused reading
because the app has not yet taken the last 64 KiB (its flow control), not while a pipelined request
waits for the one before it, not while an `Expect: 100-continue` client waits for the server's go. A
client is never judged on the server's own delays.
"""

from __future__ import annotations

import time

from uvicorn.protocols.http.flow_control import FlowControl

# Before its first bytes can be judged, a body gets 2 s: several TCP retransmissions of a lost first
# segment (Linux's minimum RTO is 0.2 s, doubling), and the time a client may take between writing its
# headers and its body. After that each KiB it has sent buys it 1/--min-body-rate-kb more seconds.
GRACE_S = 2.0


class TimedFlow(FlowControl):
    """uvicorn's flow control (one per connection) that also counts the seconds in which the server did
    not ask the client for bytes: reading paused, or `hold()` until the app first asks for the body."""

    def __init__(self, transport) -> None:
        super().__init__(transport)
        self._held_s, self._since = 0.0, None
        # Set while serve/protocol.py keeps bytes it has read but not parsed (a pipeline at its bound):
        # uvicorn resumes reading after every answer and at every receive(), which would read on.
        self.blocked = False

    @property
    def holding(self) -> bool:
        return self._since is not None

    def hold(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def pause_reading(self) -> None:
        self.hold()
        super().pause_reading()

    def resume_reading(self) -> None:  # also called by each ASGI receive(): the app asks for the body
        if self.blocked:
            return
        if self._since is not None:
            self._held_s += time.monotonic() - self._since
            self._since = None
        super().resume_reading()

    def held_s(self, now: float) -> float:
        return self._held_s + (now - self._since if self._since is not None else 0.0)


class BodyPace:
    """The bytes of one request body against the seconds the server has been asking for them."""

    __slots__ = ("flow", "start", "held0", "received")

    def __init__(self, flow: TimedFlow, now: float) -> None:
        self.flow, self.start, self.held0, self.received = flow, now, flow.held_s(now), 0

    def asked_s(self, now: float) -> float:
        return now - self.start - (self.flow.held_s(now) - self.held0)

    def rate(self, now: float) -> float:
        """Bytes per second since the headers (0 before any time was asked)."""
        asked = self.asked_s(now)
        return self.received / asked if asked > 0 else 0.0

    def behind(self, now: float, min_rate: float) -> bool:
        """Below the minimum rate now, on average since the headers (never while the server is not asking)."""
        return not self.flow.holding and self.received < min_rate * self.asked_s(now)

    def behind_at(self, now: float, min_rate: float) -> float:
        """The earliest moment it can be behind (if no more bytes come and the server asks all along):
        later bytes and the server's pauses only move it later."""
        return now + self.received / min_rate - self.asked_s(now)

    def slack_s(self, now: float, min_rate: float) -> float:
        """Seconds left before the body is too slow (<= 0: it is). Constant for a body arriving at exactly
        the minimum rate; growing while the server is not asking."""
        return GRACE_S + self.received / min_rate - self.asked_s(now)
