"""Anchors of the audit log: record hashes kept outside the log and compared with it by `verify`.

A hash chain alone only shows edits by someone who does not recompute the chain. Each artifact
therefore pins a record's hash where the log cannot reach it: a checkpoint's metadata holds the
log's head when its run began, an exported artifact's sidecar the hash of its own `artifact`
record, and a run dir's lineage.json the hash of the run's `run` record. A log rewritten up to
a pinned record (a record removed, changed or re-linked before it, then the chain recomputed), or
cut off before it, no longer matches the pin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.bounded_json import load_bounded
from torchcls.errors import UserError
from torchcls.io_files import read_bytes
from torchcls.provenance.sidecars import LINEAGE_BOUNDS, check_lineage

Pin = tuple[str, dict[str, Any]]  # (where it is kept, {"seq", "hash"})
LINEAGE_JSON_BYTES = 1 << 20  # a run's lineage.json is a few hundred bytes


def pins_of(artifact: Path, lineage: dict[str, Any] | None, records: list[dict[str, Any]]) -> list[Pin]:
    """The pins that vouch for `artifact`'s part of the log: its own, and its run's lineage.json."""
    if not lineage:
        return []
    pins: list[Pin] = []
    if isinstance(lineage.get("chain_head"), dict):
        pins.append((f"{artifact.name} (its lineage)", lineage["chain_head"]))
    run_id = lineage.get("run_id")
    dirs = {artifact.resolve().parent.parent}  # runs/<name>/checkpoints/<file>
    dirs |= {Path(r["run_dir"]) for r in records if r.get("kind") == "run" and r.get("run_id") == run_id
             and isinstance(r.get("run_dir"), str) and r["run_dir"]}
    for f in sorted({d / "lineage.json" for d in dirs}):
        try:  # (the run dir is named by the log: read only a regular file, and only as much as a lineage.json)
            data = check_lineage(load_bounded(read_bytes(f, max_bytes=LINEAGE_JSON_BYTES, what="lineage.json"),
                                              LINEAGE_BOUNDS, str(f)), str(f)) if f.exists() else None
        except (UserError, OSError):  # (not JSON, past a bound, or typed otherwise than a lineage: a failed pin)
            data = {"record_seq": -1, "record_hash": "unreadable", "run_id": run_id}
        if isinstance(data, dict) and data.get("run_id") == run_id and "record_seq" in data:
            pins.append((str(f), {"seq": data["record_seq"], "hash": data.get("record_hash")}))
    return pins


def check_pins(pins: list[Pin], records: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(problems, confirmations), one line per pin."""
    by_seq = {r.get("seq"): r for r in records}
    problems, good = [], []
    for where, pin in pins:
        rec = by_seq.get(pin.get("seq"))
        if rec is None:
            problems.append(f"{where} pins record seq {pin.get('seq')} ({str(pin.get('hash'))[:16]}…), which the "
                            "log no longer holds: records were removed from its end")
        elif rec.get("hash") != pin.get("hash"):
            problems.append(f"{where} pins record seq {pin['seq']} as {str(pin.get('hash'))[:16]}…, the log holds "
                            f"{str(rec.get('hash'))[:16]}…: the log was rewritten up to that record")
        else:
            good.append(f"seq {pin['seq']} matches {where}")
    return problems, good
