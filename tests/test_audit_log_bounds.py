"""The audit log's values are bounded before they are parsed, and its readers stream it.

0bcf6c5 parsed each line (up to 1 MiB) with plain json.loads and kept every entry of the log in a list:
60 lines of `[[],[],...]` (59 MiB) took `verify` to 1.47 GB. Now each line is parsed under
records.LINE_BOUNDS (values counted from the bytes first), and verify, verify-log and the .pt2 trust
check keep running state and a handful of records, not the log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchcls.errors import UserError
from torchcls.governance.log_search import second_pass
from torchcls.governance.logcheck import verify_log
from torchcls.provenance.lineage import AuditLog
from torchcls.provenance.records import GENESIS, LINE_BOUNDS, ChainCheck, read_entries, record_hash

PEAK_PROBE = """
import resource, sys
from torchcls.governance.logcheck import verify_log
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = verify_log(sys.argv[1])
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
print(result.status, grew, result.checks[0].detail[:300])
"""


def _peak(log: Path) -> tuple[str, int, str]:
    """(status, peak RSS growth in MiB, the chain check's detail) of verify_log(log), in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(log)], capture_output=True, text=True, timeout=300,
                         check=True).stdout.split(" ", 2)
    return out[0], int(out[1]), out[2]


def _chain(records: list[dict]) -> list[bytes]:
    """Lines of a valid unsigned log holding `records` (payloads), linked and hashed."""
    lines, prev = [], GENESIS
    for seq, payload in enumerate(records):
        rec = {"seq": seq, "prev": prev, "time": "t", "kind": "note", **payload}
        rec["hash"] = prev = record_hash(rec)
        lines.append(json.dumps(rec, sort_keys=True).encode())
    return lines


def test_lines_of_a_million_empty_lists_are_refused_before_they_are_parsed(tmp_path: Path) -> None:
    junk = b"[" + b",".join([b"[]"] * 349_000) + b"]"  # 1 MiB of JSON: 349,001 values
    log = tmp_path / "audit.jsonl"
    with log.open("wb") as f:
        for seq in range(60):
            f.write(b'{"seq": %d, "prev": "%s", "hash": "%s", "kind": "x", "time": "t", "pad": %s}\n'
                    % (seq, GENESIS.encode(), GENESIS.encode(), junk))
    status, grew, detail = _peak(log)
    assert status == "failed" and f"over the bound of {LINE_BOUNDS.max_values}" in detail
    assert grew < 150, f"peak RSS grew {grew} MiB on a {log.stat().st_size >> 20} MiB log (0bcf6c5: 1,469 MiB)"


def test_verify_log_streams_the_log(tmp_path: Path) -> None:
    # 300 records of 9,000 numbers each: within the bounds, ~12 MiB of text, ~100 MiB as Python objects
    log = tmp_path / "audit.jsonl"
    log.write_bytes(b"\n".join(_chain([{"n": list(range(9_000))} for _ in range(300)])) + b"\n")
    status, grew, detail = _peak(log)
    assert status == "unverified" and "300 records, every line a record, chain intact" in detail
    assert grew < 40, f"peak RSS grew {grew} MiB: the records were kept"


@pytest.mark.parametrize("last,torn", [
    (b'{"seq": 1, "prev": "', True),  # an append cut off: reported, not failed
    (b'{"seq": 1, "x": NaN}', False),  # complete JSON, not a record: a problem even at the end
    (b"[" + b"[]," * 20_000 + b"[]]", False),  # over the bounds: no prefix of a record is
    (b"{" * 50, True),
])
def test_only_a_cut_off_last_line_counts_as_torn(tmp_path: Path, last: bytes, torn: bool) -> None:
    log = tmp_path / "audit.jsonl"
    log.write_bytes(_chain([{}])[0] + b"\n" + last)
    res = verify_log(log)
    assert res.status == ("unverified" if torn else "failed"), res.checks[0].detail
    assert ("incomplete record" in res.checks[0].detail) is torn


def test_every_line_is_checked_against_the_same_bounds(tmp_path: Path) -> None:
    for line, message in ((b'{"a": 1, "a": 2}', "appears twice"), (b"[" * 9 + b"]" * 9, "deeper than 8"),
                          (b'{"x": 1e999}', "does not fit a float")):
        log = tmp_path / "audit.jsonl"
        log.write_bytes(_chain([{}])[0] + b"\n" + line + b"\n")
        res = verify_log(log)
        assert res.status == "failed" and message in res.checks[0].detail, (line, res.checks[0].detail)


def test_an_append_is_held_to_the_bounds_its_reader_holds(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append("note", {"n": 1})
    with pytest.raises(UserError, match="not one the log's reader takes .*over the bound of 10000.*nothing was"):
        log.append("note", {"n": list(range(20_000))})
    assert verify_log(log.path).status == "unverified" and len(log.path.read_bytes().splitlines()) == 1


def test_a_log_that_changes_between_verify_passes_is_noticed(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    log.write_bytes(b"\n".join(_chain([{"n": i} for i in range(3)])) + b"\n")
    first = ChainCheck()
    with log.open("rb") as f:
        for e in read_entries(f):
            first.feed(e)
        assert second_pass(f, first, {1}, None)[2]
    log.write_bytes(b"\n".join(_chain([{"n": i} for i in range(4)])) + b"\n")
    with log.open("rb") as f:
        pinned, _, same, _ = second_pass(f, first, {1}, None)
    assert not same and pinned[0]["seq"] == 1


def test_many_junk_lines_list_a_thousand_problems_and_count_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    log.write_bytes(b"x\n" * 5_000)
    res = verify_log(log)
    assert res.status == "failed" and "(+4995 more)" in res.checks[0].detail
