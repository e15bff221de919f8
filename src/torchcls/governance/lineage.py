"""The audit log: an append-only JSON-lines file where each record carries the hash of the one
before it (a hash chain). Changing, removing or reordering any record breaks every link after
it, and `check_chain` names the first record that no longer fits.

A record is {"seq", "prev", "time", "kind", ...payload, "hash"} where hash = SHA-256 of the
canonical JSON of everything else. Appends hold an exclusive lock on the file, so runs in
parallel processes cannot fork the chain.
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

GENESIS = "0" * 64
STORE_DIR = "_governance"


def default_audit_log(out_dir: str | Path = "runs") -> Path:
    return Path(out_dir) / STORE_DIR / "audit.jsonl"


def manifest_store(audit_log: Path) -> Path:
    """Manifests are kept beside the log, content-addressed by their hash, so records stay small."""
    return audit_log.parent / "manifests"


def record_hash(record: dict[str, Any]) -> str:
    return sha256_json({k: v for k, v in record.items() if k != "hash"})


@dataclass
class ChainProblem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"audit log line {self.line}: {self.message}"


class AuditLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.seek(0)
                last = None
                for line in f:
                    if line.strip():
                        last = line
                prev = json.loads(last) if last else None
                record = {"seq": prev["seq"] + 1 if prev else 0, "prev": prev["hash"] if prev else GENESIS,
                          "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "kind": kind,
                          **payload}
                record["hash"] = record_hash(record)
                f.seek(0, os.SEEK_END)
                f.write(json.dumps(record, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return record

    def records(self) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
        """(line number, parsed record or None when unparsable, raw line)."""
        if not self.path.is_file():
            raise UserError(f"audit log {self.path} does not exist (runs append to OUT_DIR/{STORE_DIR}/audit.jsonl; "
                            "pass --audit-log FILE)")
        with open(self.path) as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    rec = None
                yield n, rec if isinstance(rec, dict) else None, line

    def check_chain(self) -> list[ChainProblem]:
        """Every broken link, in order; empty when the log is intact."""
        problems, prev_hash, expected_seq = [], GENESIS, 0
        for n, rec, _ in self.records():
            if rec is None:
                problems.append(ChainProblem(n, "not a JSON record (the file was edited)"))
                prev_hash, expected_seq = None, expected_seq + 1
                continue
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
        return problems
