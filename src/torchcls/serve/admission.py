"""Which connections `torchcls serve` keeps at --max-connections (serve/protocol.py asks and tells).

Every open connection holds one of --max-connections slots, or one of RESERVE more, let in when no
slot can be freed so that health probes and /metrics, which need no body and no model, are still
answered. A slot is freed by closing a connection that holds it without using it, in this order,
the oldest first in each group:

  begun    sent part of a request's headers and not the rest (a slowloris)
  bodies   receiving a request body, behind the minimum rate (--min-body-rate-kb, serve/pace.py): 408
  fresh    sent nothing since it opened, for over FRESH_GRACE_S (a new client's request is on its way)
  served   idle since its last answer (a pooled keep-alive client, which reconnects)

None of them holds anything of value, and a client that has been served goes last. A connection
let in on the reserve claims a slot once its request's headers are in, freeing one then if it must
(a burst of new connections is all fresh when it arrives, and behind or begun a moment later); a
request that gets none is answered 503 at once, except the probes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torchcls.serve.pace import BodyPace

RESERVE = 64  # connections beyond --max-connections kept for probes when none can be closed
FRESH_GRACE_S = 1.0  # a new connection is not closed before it had this long to send its request


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    min_body_rate: float = 0.0  # bytes/s; 0 = no minimum


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
        self.fresh: dict[Conn, float] = {}  # -> when it opened
        self.served: dict[Conn, None] = {}
        # A request whose client left after sending all of it still runs (parsing, the model): it counts
        # against --max-connections until it ends, as its connection did.
        self.orphans: set[asyncio.Task] = set()

    def _behind_body(self) -> Conn | None:
        """The request receiving its body longest among those behind the minimum rate. The oldest, not the
        slowest: a new honest request, whose body may be a few packets behind its headers, is the newest
        and so the last in line, and the walk stops at the first one behind (O(1) in a flood; it skips only
        bodies that keep up). No grace: a flood whose closed connections reconnect at once would keep all
        of its connections inside any grace, and hold every slot again."""
        rate = self.limits.min_body_rate
        if not rate or not self.bodies:
            return None
        now = time.monotonic()
        return next((conn for conn in self.bodies if conn.pace.behind(now, rate)), None)

    def _victim(self) -> Conn | None:
        if self.begun:
            return next(iter(self.begun))
        if (slow := self._behind_body()) is not None:
            return slow
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
        self.busy(conn)
