"""What `verify` looks up in the audit log for one artifact, found while the log streams past.

A log holds up to MAX_RECORDS records; verify needs a handful: the last record that produced the
artifact (its hash, its lineage's run and artifact id), its run's last `run` record, and the records
that pins outside the log name by seq. So nothing is kept but those: `ArtifactSearch.see` is shown
every record of the first pass (records.py has bounded each), and keeps at most one of each; the run
and the pinned seqs are known only after it, so `second_pass` reads the same open file again for
them, and checks on the way that it holds the very chain the first pass verified (same head, same
count): a log rewritten between the passes is a failure, not a mixed answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from torchcls.provenance.records import ChainCheck, read_entries

MAX_RUN_DIRS = 16  # run dirs whose lineage.json may pin the run record (a run resumed elsewhere adds one)


def artifacts_of(rec: dict[str, Any]) -> list[dict[str, str]]:
    """The files a record names, {path, sha256}, as strings (a record's payload is not trusted for shape)."""
    if rec.get("kind") == "run":
        found = rec.get("artifacts") if isinstance(rec.get("artifacts"), list) else []
    elif rec.get("kind") == "artifact":
        found = [rec]
    else:
        return []
    return [{"path": a["path"], "sha256": a["sha256"]} for a in found
            if isinstance(a, dict) and isinstance(a.get("path"), str) and isinstance(a.get("sha256"), str)]


class ArtifactSearch:
    """The records that vouch for `artifact` (SHA-256 `digest`), per its `lineage` (None: by hash only)."""

    def __init__(self, artifact: Path, digest: str, lineage: dict[str, Any] | None):
        self.artifact, self.digest, self.lineage = artifact, digest, lineage
        self.run_id = lineage.get("run_id") if lineage else None
        self.claimed = False  # a record of the lineage's run (or of its exports) exists
        self.mine: tuple[dict[str, Any], dict[str, str]] | None = None  # the last naming this file, any hash
        self.produced: tuple[dict[str, Any], dict[str, str]] | None = None  # the last naming it with its hash
        self.run_dirs: set[str] = set()  # of the lineage's run records, for their lineage.json pins

    def see(self, rec: dict[str, Any]) -> None:
        if self.lineage is None:
            for a in artifacts_of(rec):
                if a["sha256"] == self.digest:
                    self.produced = (rec, a)
            return
        if rec.get("kind") == "run" and rec.get("run_id") == self.run_id and isinstance(rec.get("run_dir"), str) \
                and rec["run_dir"] and len(self.run_dirs) < MAX_RUN_DIRS:
            self.run_dirs.add(rec["run_dir"])
        if rec.get("run_id") != self.run_id and rec.get("parent_run_id") != self.run_id:
            return
        wanted_id = self.lineage.get("artifact_id")
        for a in artifacts_of(rec):
            self.claimed = True
            if Path(a["path"]).name == self.artifact.name and (wanted_id is None or rec.get("artifact_id") == wanted_id):
                self.mine = (rec, a)
                if a["sha256"] == self.digest:
                    self.produced = (rec, a)

    def run_records(self) -> list[dict[str, Any]]:
        """The lineage's run records as anchors.pins_of reads them (only their run dirs are needed)."""
        return [{"kind": "run", "run_id": self.run_id, "run_dir": d} for d in sorted(self.run_dirs)]

    def produced_run(self) -> Any:
        """The run the producing record belongs to (None when no record produced the artifact)."""
        if self.produced is None:
            return None
        rec = self.produced[0]
        return rec.get("run_id") or rec.get("parent_run_id")

    def produced_parent(self) -> Any:
        """The SHA-256 of the checkpoint an exported artifact's record says it was built from (None: no such record)."""
        return self.produced[0].get("parent_sha256") if self.produced and self.produced[0].get("kind") == "artifact" \
            else None


def second_pass(f: IO[bytes], first: ChainCheck, seqs: set[Any], run_id: Any, parent_sha256: Any = None
                ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, bool, bool]:
    """(the records at `seqs`, the last `run` record of `run_id`, whether `f` still holds the chain `first`
    checked, whether a `run` record of `run_id` lists `parent_sha256` among its files), reading `f` from its
    start again."""
    f.seek(0)
    chain, pinned, run, parent_listed = ChainCheck(), {}, None, False
    for e in read_entries(f):
        chain.feed(e)
        rec = e.record
        if rec is None:
            continue
        if rec["seq"] in seqs:
            pinned[rec["seq"]] = {"seq": rec["seq"], "hash": rec["hash"]}
        if rec.get("kind") == "run" and run_id is not None and rec.get("run_id") == run_id:
            run = rec
            parent_listed = parent_listed or any(a["sha256"] == parent_sha256 for a in artifacts_of(rec))
    same = (chain.head, chain.next_seq, chain.lines, chain.records) == (first.head, first.next_seq, first.lines,
                                                                       first.records)
    return list(pinned.values()), run, same, parent_listed
