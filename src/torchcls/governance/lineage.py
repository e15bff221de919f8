"""The audit log: an append-only JSON-lines file where each record carries the hash of the one
before it (a hash chain). Changing, removing or reordering any record breaks every link after
it, and `check_chain` names the first record that no longer fits.

A record is {"seq", "prev", "time", "kind", ...payload, ["key_id"], "hash", ["hmac"]} where hash =
SHA-256 of the canonical JSON of everything but hash and hmac, and hmac = HMAC-SHA256(audit key,
hash) when a key is set (keys.py). Appends hold an exclusive lock on the file, so runs in parallel
processes cannot fork the chain. An append interrupted mid-line (disk full) leaves a torn last
line: the next append closes it off and links to the last complete record.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.digest import sha256_json
from torchcls.governance.keys import KEY_ENV, key_id, sign, signature_ok

GENESIS = "0" * 64
STORE_DIR = "_governance"


def default_audit_log(out_dir: str | Path = "runs") -> Path:
    return Path(out_dir) / STORE_DIR / "audit.jsonl"


def manifest_store(audit_log: Path) -> Path:
    """Manifests are kept beside the log, content-addressed by their hash, so records stay small."""
    return audit_log.parent / "manifests"


def record_hash(record: dict[str, Any]) -> str:
    """SHA-256 of everything but the hash and the signature (which signs this hash)."""
    return sha256_json({k: v for k, v in record.items() if k not in ("hash", "hmac")})


@dataclass
class ChainProblem:
    line: int
    message: str
    torn: bool = False  # an interrupted append (disk full, crash): no complete record is missing

    def __str__(self) -> str:
        return f"audit log line {self.line}: {self.message}"


TORN = ("an incomplete record (an append was interrupted, e.g. the disk was full); no complete record is "
        "missing, the chain continues after it")


class AuditLog:
    """`key`: the audit key (keys.load_key); with it every appended record is signed, and a log
    whose last record is signed refuses unsigned appends or appends signed with another key."""

    def __init__(self, path: str | Path, key: bytes | None = None):
        self.path = Path(path)
        self.key = key

    def append(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.seek(0)
                text = f.read()
                prev = _last_record(text)
                self._check_key(prev)
                record = {"seq": prev["seq"] + 1 if prev else 0, "prev": prev["hash"] if prev else GENESIS,
                          "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "kind": kind,
                          **payload}
                if self.key is not None:
                    record["key_id"] = key_id(self.key)
                record["hash"] = record_hash(record)
                if self.key is not None:
                    record["hmac"] = sign(self.key, record["hash"])
                # A torn last line (no newline) is closed off, so that the new record gets its own line.
                torn = "\n" if text and not text.endswith("\n") else ""
                f.seek(0, os.SEEK_END)
                f.write(torn + json.dumps(record, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return record

    def head(self) -> dict[str, Any] | None:
        """{"seq", "hash"} of the last complete record (None for an empty or missing log): what an
        artifact pins, so that a log rewritten up to that record no longer matches it."""
        last = _last_record(self.path.read_text()) if self.path.is_file() else None
        return {"seq": last["seq"], "hash": last["hash"]} if last else None

    def check_key(self) -> None:
        """Refuse (before any work) to append to a signed log without its key, or with another key."""
        self._check_key(_last_record(self.path.read_text()) if self.path.is_file() else None)

    def _check_key(self, last: dict[str, Any] | None) -> None:
        signed_by = (last or {}).get("key_id")
        if signed_by is None:
            return
        if self.key is None:
            raise UserError(f"audit log {self.path} is signed (key id {signed_by}): set {KEY_ENV} or pass "
                            "--audit-key-file with its key, or use another --audit-log")
        if key_id(self.key) != signed_by:
            raise UserError(f"audit log {self.path} is signed with key id {signed_by}, not with the given key "
                            f"({key_id(self.key)}): pass the log's key, or use another --audit-log")

    def records(self) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
        """(line number, parsed record or None when unparsable, raw line)."""
        if not self.path.is_file():
            raise UserError(f"audit log {self.path} does not exist (runs append to OUT_DIR/{STORE_DIR}/audit.jsonl; "
                            "pass --audit-log FILE)")
        with open(self.path) as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                yield n, _parse(line), line

    def check_chain(self) -> list[ChainProblem]:
        """Every broken link, in order; empty when the log is intact. An unparsable line that the next
        record links over (or an unterminated last line) is a torn append, flagged `torn`."""
        problems, prev_hash, expected_seq = [], GENESIS, 0
        pending: list[tuple[int, str]] = []  # unparsable lines, judged by the record after them
        for n, rec, raw in self.records():
            if rec is None:
                pending.append((n, raw))
                continue
            links_over = rec.get("prev") == prev_hash and rec.get("seq") == expected_seq
            for m, _ in pending:
                problems.append(ChainProblem(m, TORN, True) if links_over else
                                ChainProblem(m, "not a JSON record (the file was edited)"))
            if pending and not links_over:  # an edited line: judge what follows on its own
                prev_hash, expected_seq = None, expected_seq + len(pending)
            pending = []
            if rec.get("hash") != record_hash(rec):
                problems.append(ChainProblem(n, f"record seq {rec.get('seq')} ({rec.get('kind')}) does not match "
                                                "its own hash: its content was changed"))
            if prev_hash is not None and rec.get("prev") != prev_hash:
                problems.append(ChainProblem(n, f"record seq {rec.get('seq')} does not link to the record before "
                                                "it: a record was removed, inserted or reordered"))
            if rec.get("seq") != expected_seq:
                problems.append(ChainProblem(n, f"sequence number {rec.get('seq')} where {expected_seq} was "
                                                "expected: records were removed or reordered"))
            prev_hash, expected_seq = rec.get("hash"), expected_seq + 1
        for m, raw in pending:  # at the end: torn when the write stopped before its newline
            problems.append(ChainProblem(m, TORN, True) if not raw.endswith("\n") else
                            ChainProblem(m, "not a JSON record (the file was edited)"))
        return problems

    def check_signatures(self, key: bytes) -> list[ChainProblem]:
        """Every record not signed with `key` (torn lines aside): with a key, no record may be unsigned."""
        mine, problems = key_id(key), []
        for n, rec, _ in self.records():
            if rec is None:
                continue
            seq, signer = rec.get("seq"), rec.get("key_id")
            if signer is None or "hmac" not in rec:
                problems.append(ChainProblem(n, f"record seq {seq} is not signed: written without the audit key "
                                                "(before it was set up: start a new --audit-log when introducing "
                                                "a key) or re-written by someone without it"))
            elif signer != mine:
                problems.append(ChainProblem(n, f"record seq {seq} is signed with key id {signer}, the given key "
                                                f"is {mine}"))
            elif not signature_ok(key, record_hash(rec), rec["hmac"]):
                problems.append(ChainProblem(n, f"record seq {seq}: its signature does not match: the record was "
                                                "changed or re-linked by someone without the key"))
        return problems


def _parse(line: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) else None


def _last_record(text: str) -> dict[str, Any] | None:
    """The last complete record; unparsable (torn) lines after it are skipped, never a complete record."""
    for line in reversed(text.splitlines()):
        rec = _parse(line) if line.strip() else None
        if rec is not None and "hash" in rec and isinstance(rec.get("seq"), int):
            return rec
    return None
