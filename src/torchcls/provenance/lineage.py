"""The audit log: an append-only JSON-lines file where each record carries the hash of the one
before it (a hash chain). Changing, removing or reordering any record breaks every link after
it, and `check_chain` names the first record that no longer fits.

A record is {"seq", "prev", "time", "kind", ...payload, ["signer"], "hash"} where hash = SHA-256 of
the canonical JSON of everything but hash (and a legacy hmac). With a signing key (signing.py) each
line is a DSSE envelope (dsse.py) whose payload is the record, signed with the private key and naming
its signer {keyid, public_key}: anyone with the public key can check it, only the key's holder can
write it. With only a legacy audit key (keys.py) the line is the record itself plus key_id and
hmac = HMAC-SHA256(key, hash); without either, the record unsigned. Appends hold an exclusive lock on
the file, so runs in parallel processes cannot fork the chain. An append interrupted mid-line (disk
full) leaves a torn last line: the next append cuts it off and links to the last complete record.
Reading is bounded and strict (records.py): every line must be a record, except a torn last one.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from torchcls.errors import UserError
from torchcls.io_files import open_regular
from torchcls.provenance import dsse
from torchcls.provenance.digest import canonical_json
from torchcls.provenance.keys import KEY_ENV, key_id, sign
from torchcls.provenance.records import (
    GENESIS,
    ChainCheck,
    ChainProblem,
    Entry,
    check_line,
    read_entries,
    read_tail,
    record_hash,
    signed_how,
)
from torchcls.provenance.signatures import Trusted, check_signatures
from torchcls.provenance.signing import SIGNING_KEY_ENV, Signer, short

STORE_DIR = "_governance"
__all__ = ["GENESIS", "STORE_DIR", "AuditLog", "ChainProblem", "record_hash"]


def default_audit_log(out_dir: str | Path = "runs") -> Path:
    return Path(out_dir) / STORE_DIR / "audit.jsonl"


def manifest_store(audit_log: Path) -> Path:
    """Manifests are kept beside the log, content-addressed by their hash, so records stay small."""
    return audit_log.parent / "manifests"


def _open_for_append(path: Path) -> IO[bytes]:
    """Read-write and appending, created when missing; never blocks on or writes into anything but a
    regular file (the log's path can come from an artifact's lineage)."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"audit log {path} is not a regular file: refusing to append to it")
    return os.fdopen(fd, "r+b")


class AuditLog:
    """`signer`: the signing key (signing.signer_from); `key`: the legacy HMAC audit key (keys.load_key),
    used only when there is no signer. A log whose last record is signed refuses unsigned appends, and
    appends signed more weakly (an HMAC after a key pair) or with another HMAC key."""

    def __init__(self, path: str | Path, key: bytes | None = None, signer: Signer | None = None):
        self.path = Path(path)
        self.key = key
        self.signer = signer

    def append(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _open_for_append(self.path) as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                tail = self._tail(f)
                self._check_key(tail.last)
                prev = tail.last
                record = {"seq": prev["seq"] + 1 if prev else 0, "prev": prev["hash"] if prev else GENESIS,
                          "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "kind": kind,
                          **payload}
                line = self._signed_line(record)
                if tail.torn_at is not None:  # an interrupted append's fragment: never a record, cut off
                    f.truncate(tail.torn_at)
                f.write((b"\n" if tail.needs_newline else b"") + line + b"\n")  # (a+: always at the end)
                f.flush()
                os.fsync(f.fileno())
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return record

    def _signed_line(self, record: dict[str, Any]) -> bytes:
        """The line for `record` (completed in place with its signer and hash)."""
        if self.signer is not None:
            record["signer"] = {"keyid": self.signer.keyid, "public_key": self.signer.public_b64}
        elif self.key is not None:
            record["key_id"] = key_id(self.key)
        record["hash"] = record_hash(record)
        if self.signer is not None:
            env = dsse.sign(dsse.RECORD_TYPE, canonical_json(record), self.signer)
            line = json.dumps(env.to_json(), sort_keys=True).encode()
        else:
            if self.key is not None:
                record["hmac"] = sign(self.key, record["hash"])
            line = json.dumps(record, sort_keys=True).encode()
        check_line(line, record["kind"])  # the bounds the reader holds it to (records.py)
        return line

    def _tail(self, f: IO[bytes]):
        try:
            return read_tail(f, f"audit log {self.path}")
        except ValueError as e:
            raise UserError(f"{e}: the log was edited or damaged; check it with `torchcls governance verify-log "
                            f"{self.path}` and start a new --audit-log") from None

    def _last(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        with open_regular(self.path, what="audit log") as f:
            return self._tail(f).last

    def head(self) -> dict[str, Any] | None:
        """{"seq", "hash"} of the last complete record (None for an empty or missing log): what an
        artifact pins, so that a log rewritten up to that record no longer matches it."""
        last = self._last()
        return {"seq": last["seq"], "hash": last["hash"]} if last else None

    def check_key(self) -> None:
        """Refuse (before any work) to append to a signed log without a key, or with a weaker or other one."""
        self._check_key(self._last())

    def _check_key(self, last: dict[str, Any] | None) -> None:
        how = signed_how(last)
        if how == "key pair" and self.signer is None:
            raise UserError(f"audit log {self.path} is signed with a key pair (key id {short(last['signer']['keyid'])}): "
                            f"set {SIGNING_KEY_ENV} or --signing-key-file to a signing key, or use another --audit-log")
        if how != "hmac" or self.signer is not None:
            return  # unsigned so far, or signed with a key pair: any signing key may append (verify decides trust)
        if self.key is None:
            raise UserError(f"audit log {self.path} is signed (key id {last['key_id']}): set {KEY_ENV} or pass "
                            "--audit-key-file with its key (or a signing key: --signing-key-file), or use another "
                            "--audit-log")
        if key_id(self.key) != last["key_id"]:
            raise UserError(f"audit log {self.path} is signed with key id {last['key_id']}, not with the given key "
                            f"({key_id(self.key)}): pass the log's key, or use another --audit-log")

    def entries(self) -> Iterator[Entry]:
        """Every line, parsed and checked for shape (records.py), read line by bounded line."""
        with self.open() as f:
            yield from read_entries(f)

    def open(self) -> IO[bytes]:
        """The log, opened for reading (a regular file only: a FIFO would block)."""
        if not self.path.exists():
            raise UserError(f"audit log {self.path} does not exist (runs append to OUT_DIR/{STORE_DIR}/audit.jsonl; "
                            "pass --audit-log FILE)")
        return open_regular(self.path, what="audit log")

    def records(self) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
        """(line number, the record or None when the line is not one, what is wrong with the line)."""
        for e in self.entries():
            yield e.line, e.record, e.problem or ""

    def check_chain(self) -> list[ChainProblem]:
        """Every line that is not a record and every broken link, in order; empty when the log is intact.
        Only a torn last line is flagged `torn` (reported, not failed)."""
        return chain_problems(self.entries())

    def check_signatures(self, key: bytes) -> list[ChainProblem]:
        """Every record not signed with the legacy HMAC `key` (unparsable lines aside: check_chain's)."""
        report = check_signatures(self.entries(), Trusted(hmac=key))
        return [ChainProblem(n, m) for n, m in report.problems]


def chain_problems(entries: Iterable[Entry]) -> list[ChainProblem]:
    """What AuditLog.check_chain reports, for entries read (streamed: records.ChainCheck keeps none)."""
    chain = ChainCheck()
    for e in entries:
        chain.feed(e)
    return chain.all_problems()
