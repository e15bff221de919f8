"""Which connections `torchcls serve` keeps at --max-connections (serve/protocol.py asks and tells).

Every open connection holds one of --max-connections slots, or one of RESERVE more, let in when no
slot can be freed so that health probes and /metrics, which need no body and no model, are still
answered. A slot is freed by closing a connection that holds it without using it, in this order:

  begun    sent part of a request's headers and not the rest (a slowloris), the oldest first
  bodies   receiving a request body, behind the minimum rate (--min-body-rate-kb, serve/pace.py): 408,
           the one behind for longest first
  stalled  an answer waiting for its client to read it (writing paused), the oldest first
  fresh    sent nothing since it opened, for over FRESH_GRACE_S (a new client's request is on its way)
  served   idle since its last answer (a pooled keep-alive client, which reconnects), the oldest first

None of them holds anything of value, and a client that has been served goes last. A connection
let in on the reserve claims a slot once its request's headers are in, freeing one then if it must
(a burst of new connections is all fresh when it arrives, and behind or begun a moment later); a
request that gets none is answered 503 at once, except the probes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torchcls.serve.pace import BodyPace

RESERVE = 64  # connections beyond --max-connections kept for probes when none can be closed
FRESH_GRACE_S = 1.0  # a new connection is not closed before it had this long to send its request
RECHECK_S = 0.05  # a body not behind now is looked at again no sooner than this


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    min_body_rate: float = 0.0  # bytes/s; 0 = no minimum
    send_timeout: float = 30.0  # seconds an answer may wait for its client to read it


class Conn(Protocol):  # what serve/protocol.py's GuardedProtocol offers here
    pace: BodyPace | None

    def evict(self) -> None: ...


class Connections:
    """The open connections of one server, those it may close to make room (the groups above, in
    insertion order = oldest first), and the requests still running for clients that have gone."""

    def __init__(self, limits: ConnectionLimits, record: Callable[[str], None]):
        self.limits, self.record = limits, record
        self.open: set[Conn] = set()
        self.reserve: set[Conn] = set()  # open beyond --max-connections, without a slot
        self.begun: dict[Conn, None] = {}
        self.bodies: dict[Conn, None] = {}  # since their headers are in
        # The bodies by the earliest moment each can be behind (BodyPace.behind_at), a lower bound updated
        # when looked at: entries of bodies that ended are dropped when they come up.
        self._due: list[tuple[float, int, BodyPace, Conn]] = []
        self._order = itertools.count()
        self.stalled: dict[Conn, None] = {}  # writing paused: the client is not reading its answers
        self.fresh: dict[Conn, float] = {}  # -> when it opened
        self.served: dict[Conn, None] = {}
        # A request whose client left after sending all of it still runs (parsing, the model): it counts
        # against --max-connections until it ends, as its connection did.
        self.orphans: set[asyncio.Task] = set()

    def receiving(self, conn: Conn) -> None:
        """Its request's headers are in and its body is on its way (conn.pace counts it)."""
        self.bodies[conn] = None
        if len(self._due) > 2 * len(self.bodies) + 64:  # mostly bodies that ended: start over
            self._due = [(c.pace.start, next(self._order), c.pace, c) for c in self.bodies]
            heapq.heapify(self._due)
        else:
            heapq.heappush(self._due, (conn.pace.start, next(self._order), conn.pace, conn))

    def _behind_body(self) -> Conn | None:
        """The body behind the minimum rate for longest. A new honest request, whose body may be a few
        packets behind its headers, fell behind last and so is the last in line. Only the bodies that may
        be behind by now are looked at (a heap by that moment): a walk over every body, as before, cost
        O(bodies) per new connection at the cap while they all kept up. No grace: a flood whose closed
        connections reconnect at once would keep all of its connections inside any grace, and hold every
        slot again."""
        rate, due = self.limits.min_body_rate, self._due
        if not rate or not self.bodies:
            return None
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, pace, conn = due[0]
            if conn.pace is not pace or conn not in self.bodies:
                heapq.heappop(due)  # that body has ended
            elif pace.behind(now, rate):
                return conn  # its entry goes when it is closed
            else:
                heapq.heapreplace(due, (max(pace.behind_at(now, rate), now + RECHECK_S), next(self._order),
                                        pace, conn))
        return None

    def _victim(self) -> Conn | None:
        if self.begun:
            return next(iter(self.begun))
        if (slow := self._behind_body()) is not None:
            return slow
        if self.stalled:
            return next(iter(self.stalled))
        if self.fresh:
            oldest, since = next(iter(self.fresh.items()))
            if time.monotonic() - since > FRESH_GRACE_S:
                return oldest
        return next(iter(self.served), None)

    def _slot(self) -> bool:
        """A slot is free, or was freed by closing connections that did not use theirs."""
        while len(self.open) - len(self.reserve) + len(self.orphans) >= self.limits.max_connections:
            victim = self._victim()
            if victim is None:
                return False
            victim.evict()  # it leaves `open` (one on the reserve frees no slot: then the next is closed)
        return True

    def admit(self, conn: Conn) -> bool:
        """A new connection: a slot, else the reserve, else False (close it unread)."""
        if not self._slot():
            if len(self.reserve) >= RESERVE:
                self.record("refused")
                return False
            self.reserve.add(conn)
        self.open.add(conn)
        return True

    def claim(self, conn: Conn) -> bool:
        """Its request's headers are in: does it hold a slot (taking one now if it was on the reserve)?"""
        if conn not in self.reserve:
            return True
        if not self._slot():
            return False
        self.reserve.discard(conn)
        return True

    def orphan(self, task: asyncio.Task) -> None:
        self.orphans.add(task)
        task.add_done_callback(self.orphans.discard)

    def busy(self, conn: Conn) -> None:
        """No longer waiting for request headers."""
        self.begun.pop(conn, None)
        self.fresh.pop(conn, None)
        self.served.pop(conn, None)

    def drop(self, conn: Conn) -> None:
        self.open.discard(conn)
        self.reserve.discard(conn)
        self.bodies.pop(conn, None)
        self.stalled.pop(conn, None)
        self.busy(conn)
