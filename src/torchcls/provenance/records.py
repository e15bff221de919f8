"""Reading the audit log: bounded, strict, one line at a time.

Every line is one well-formed record: a JSON record (unsigned, or HMAC-signed as torchcls wrote them
before public-key signatures), or a DSSE envelope (dsse.py) whose payload is a record naming its
signer. The one exception is a torn last line: no newline after it and not JSON, which is what an
interrupted append leaves (the next append removes it). Anything else, anywhere (a junk line at the
top, an empty line, a line of JSON that is not a record, a second torn line), is a problem that
`verify` fails on, with or without a key: an unparsable line cannot be told apart from a record
that was removed or hidden.

Bounds, each checked before memory in proportion to it is spent:
- MAX_LINE_BYTES per line: lines are read with a capped readline, so a 1 GB line costs one cap's
  worth of memory (it is skipped in pieces and reported), never the whole line;
- LINE_BOUNDS on what one line (and a signed line's payload, the record) may describe: the values
  are counted from the bytes before the parse (bounded_json), so a megabyte of `[[],[],...]` is
  refused, not turned into half a million lists; nesting, strings, duplicate keys and non-finite
  numbers are checked too. The writer checks the same bounds (check_line) before it appends;
- MAX_RECORDS lines per log; readers stream the log (ChainCheck here, the signature check, verify's
  search for an artifact's records) and keep only running state and the few records they need;
- MAX_PROBLEMS_KEPT problems listed per check (the rest counted).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Annotated, Any

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.provenance import dsse
from torchcls.provenance.digest import sha256_json
from torchcls.provenance.signing import looks_like_key_id
from torchcls.typed_json import SchemaMismatch, check, sha256_type

MAX_LINE_BYTES = 1 << 20  # a record is a few KB (a run record with its config and package versions)
MAX_RECORDS = 1_000_000
# A run record (the largest) holds a few hundred values nested 4 deep (record > config > section > list).
# Strings may be as long as the line: a signed line's payload, the base64 of the record, is one string.
LINE_BOUNDS = JsonBounds(max_bytes=MAX_LINE_BYTES, max_values=10_000, max_depth=8, max_str=MAX_LINE_BYTES)
MAX_PROBLEMS_KEPT = 1000  # a log of a million junk lines lists the first thousand and counts the rest
GENESIS = "0" * 64
_HEX = frozenset("0123456789abcdef")
NOT_JSON = "not a JSON record (the file was edited)"
# A run record's lists, each bounded: verify parses and re-hashes per manifest, so a line repeating one summary
# thousands of times (the line bounds allow 10,000 values) would multiply that work.
MAX_RUN_MANIFESTS = 16  # torchcls lists at most 2: the data's and --val-data's (governance/run.py _record_run)
# torchcls lists only the checkpoint files its trainer wrote, at most 3 (checkpointer.py: last.safetensors,
# last.state.safetensors, best.safetensors; a sharded run's last.dcp is a folder, not listed); the rest is room
# for a newer torchcls's files
MAX_RUN_ARTIFACTS = 64
MAX_RUN_HOOKS = 256  # the --hooks names, each a registered hook or an installed package's: a handful


class RunManifest(TypedDict):
    """One data manifest a run record lists (governance/run.py `_manifest_summary`): verify looks it up in the
    manifest store by its digest and compares its Merkle root; export's attestation names both. Every torchcls
    wrote both (since the first run record, 4af7ec7): a summary without them names nothing to check."""

    manifest_sha256: sha256_type()
    merkle_root: str
    name: NotRequired[str | None]
    records: NotRequired[int]
    manifest_hash_version: NotRequired[int]  # absent: recorded before dateCreated was hashed (version 1)


class RunArtifact(TypedDict):
    """A file a run wrote, as its run record lists it: verify, export's registration and `lineage --file` match
    files by it."""

    path: str
    sha256: sha256_type()
    artifact_kind: NotRequired[str]


class RunRecord(TypedDict, total=False):
    """The fields of a `run` record (governance/run.py) that torchcls reads back: verify (the run, its manifests,
    its policy, region and hooks), export's registration (`artifacts.backed_parent`) and `lineage --file`. Every
    field is optional, as consumers ask for them with .get; the record's other fields (config, environment,
    metrics: a newer torchcls's too) pass unread."""

    run_id: str
    run_dir: str
    code_version: str
    manifests: Annotated[list[RunManifest], Field(max_length=MAX_RUN_MANIFESTS)]
    artifacts: Annotated[list[RunArtifact], Field(max_length=MAX_RUN_ARTIFACTS)]
    policy: dict[str, Any] | None  # Policy.to_dict(); policy_from_dict checks its fields when verify reads it
    region: str | None
    hooks: Annotated[list[str], Field(max_length=MAX_RUN_HOOKS)]


class ArtifactRecord(TypedDict):
    """The fields of an `artifact` record (governance/artifacts.py `register_artifact`, which every export's
    registration goes through) that torchcls reads back: verify (the file's digest, its parent run and checkpoint),
    predict's and serve's pinned-digest check and trust (by artifact id), `lineage --file` (path, kind, parent run,
    which it keeps in a set). The record's other fields (details: a newer torchcls's too) pass unread."""

    path: str
    sha256: sha256_type()
    artifact_id: NotRequired[str]
    parent_run_id: NotRequired[str]
    parent_sha256: NotRequired[sha256_type()]  # the checkpoint it was built from: verify holds it against the run
    artifact_kind: NotRequired[str]


def record_hash(record: dict[str, Any]) -> str:
    """SHA-256 of everything but the hash and a legacy HMAC (which signs this hash)."""
    return sha256_json({k: v for k, v in record.items() if k not in ("hash", "hmac")})


def signed_how(rec: dict[str, Any] | None) -> str | None:
    """'key pair', 'hmac' or None (unsigned) for a record as read."""
    if rec is None:
        return None
    return "key pair" if "signer" in rec else "hmac" if "key_id" in rec else None


@dataclass
class Entry:
    """One line of the log. `record`: the record (a signed one's payload) when the line is well formed."""

    line: int
    record: dict[str, Any] | None = None
    envelope: dsse.Envelope | None = None
    problem: str | None = None
    torn: bool = False  # the last line, cut off by an interrupted append: no complete record is missing


@dataclass
class ChainProblem:
    line: int
    message: str
    torn: bool = False  # an interrupted append (disk full, crash): no complete record is missing

    def __str__(self) -> str:
        return f"audit log line {self.line}: {self.message}"


class ChainCheck:
    """The hash chain, checked one line at a time with running state only (the last record's hash and
    sequence number, counts): a log of any length is checked in the memory of one line. Every line that
    is not a record is a problem (a torn last line one flagged `torn`), and so is every broken link."""

    def __init__(self) -> None:
        self.head, self.next_seq = GENESIS, 0  # the last record's hash, and the seq the next record must have
        self.lines = self.records = self.dropped = 0
        self.problems: list[ChainProblem] = []  # the first MAX_PROBLEMS_KEPT; `dropped` counts the rest

    def feed(self, e: Entry) -> None:
        self.lines += 1
        rec = e.record
        if rec is None:
            self._add(ChainProblem(e.line, e.problem or NOT_JSON, e.torn))
            return
        self.records += 1
        if rec["hash"] != record_hash(rec):
            self._add(ChainProblem(e.line, f"record seq {rec['seq']} ({rec['kind'][:80]}) does not match its own "
                                           "hash: its content was changed"))
        if rec["prev"] != self.head:
            self._add(ChainProblem(e.line, f"record seq {rec['seq']} does not link to the record before it: a "
                                           "record was removed, inserted or reordered"))
        if rec["seq"] != self.next_seq:
            self._add(ChainProblem(e.line, f"sequence number {rec['seq']} where {self.next_seq} was expected: "
                                           "records were removed or reordered"))
        self.head, self.next_seq = rec["hash"], rec["seq"] + 1

    def _add(self, problem: ChainProblem) -> None:
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(problem)
        else:
            self.dropped += 1

    def all_problems(self) -> list[ChainProblem]:
        """The problems kept, then one line counting those that were not."""
        more = [ChainProblem(self.lines, f"and {self.dropped} more problems")] if self.dropped else []
        return self.problems + more


def read_entries(f: IO[bytes]) -> Iterator[Entry]:
    """Every line of the binary file `f`, in order; at most MAX_RECORDS of them."""
    n = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        n += 1
        if n > MAX_RECORDS:
            yield Entry(n, problem=f"the log has more than {MAX_RECORDS} lines, the most torchcls reads: "
                                   "start a new --audit-log")
            return
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass  # skip the rest of the line in bounded pieces
            yield Entry(n, problem=f"a line longer than any record ({MAX_LINE_BYTES} bytes): not a record")
            continue
        yield parse_line(n, raw)


def parse_line(n: int, raw: bytes) -> Entry:
    content = raw.removesuffix(b"\n")
    at_end = not raw.endswith(b"\n")  # only the last line of a file can lack its newline
    if not content.strip():
        return Entry(n, problem="an empty line (the file was edited)")
    try:
        obj = load_bounded(content, LINE_BOUNDS, "the line")
    except UserError as e:
        if at_end and _cut_short(content):
            return Entry(n, problem="an incomplete record (an append was interrupted, e.g. the disk was full); "
                                    "no complete record is missing", torn=True)
        return Entry(n, problem=f"{NOT_JSON}: {str(e)[:300]}")
    if dsse.is_envelope(obj):
        return _signed(n, obj)
    problem = record_problem(obj)
    if problem is None and "signer" in obj:
        signer = obj["signer"].get("keyid") if isinstance(obj["signer"], dict) else obj["signer"]
        problem = (f"record seq {obj['seq']} names its signer ({str(signer)[:23]}…) but carries no signature: "
                   "the signature was removed")
    return Entry(n, obj if problem is None else None, problem=problem)


def _cut_short(content: bytes) -> bool:
    """Whether a last line that is not a record is what an interrupted append leaves: text that stops
    before its JSON ends. A line over LINE_BOUNDS is no prefix of a record, and one that parses whole is
    complete (so not torn): either is a problem wherever it is."""
    if content.count(b"{") + content.count(b"[") + content.count(b",") + 1 > LINE_BOUNDS.max_values:
        return False
    try:
        json.loads(content)  # (at most LINE_BOUNDS.max_values values: counted above)
    except (ValueError, RecursionError):
        return True
    return False


def check_line(line: bytes, kind: str) -> None:
    """What an append checks before it writes `line` (no newline): that the reader will take it as a record."""
    if len(line) > MAX_LINE_BYTES:
        raise UserError(f"audit record '{kind}' is {len(line)} bytes, more than a line of the audit log may hold "
                        f"({MAX_LINE_BYTES}); nothing was written")
    entry = parse_line(0, line + b"\n")
    if entry.record is None:
        raise UserError(f"audit record '{kind}' is not one the log's reader takes ({entry.problem}); nothing was "
                        "written")


def _signed(n: int, obj: dict[str, Any]) -> Entry:
    try:
        env = dsse.parse(obj)
        if env.payload_type != dsse.RECORD_TYPE:
            raise ValueError(f"a DSSE envelope of type {env.payload_type[:80]!r}, not an audit record")
        rec = load_bounded(env.payload, LINE_BOUNDS, "its payload")
    except (ValueError, UserError) as e:
        return Entry(n, problem=f"a malformed signed record ({str(e)[:200]})")
    problem = record_problem(rec) or _signer_problem(rec)
    if problem is None and {k for k, _ in env.signatures} != {rec["signer"]["keyid"]}:
        problem = f"record seq {rec['seq']}: its envelope is signed by another key than the one the record names"
    return Entry(n, rec if problem is None else None, env if problem is None else None, problem)


def record_problem(rec: Any) -> str | None:
    """None when `rec` has a record's shape; else what is wrong. The fields every record has, typed,
    the legacy HMAC pair complete, an artifact record's digest (export writes one; predict, serve and
    verify compare it with the file's) and fields (`ArtifactRecord`), and a run record's fields (`RunRecord`)."""
    if not isinstance(rec, dict):
        return NOT_JSON
    seq = rec.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return "a JSON line without a record's sequence number (the file was edited)"
    for k in ("prev", "hash"):
        if not _is_hex64(rec.get(k)):
            return f"record seq {seq}: '{k}' is not a SHA-256 hex digest"
    if not isinstance(rec.get("kind"), str) or not isinstance(rec.get("time"), str):
        return f"record seq {seq}: no 'kind' or 'time'"
    if ("key_id" in rec) != ("hmac" in rec) or not all(isinstance(rec.get(k, ""), str) for k in ("key_id", "hmac")):
        return f"record seq {seq}: an incomplete HMAC signature (key_id and hmac go together)"
    if rec["kind"] == "artifact" and not _is_hex64(rec.get("sha256")):  # what load_artifact and verify compare
        return f"record seq {seq}: an artifact record whose 'sha256' is not a SHA-256 hex digest"
    schema = {"run": (RunRecord, "a run record"), "artifact": (ArtifactRecord, "an artifact record")}.get(rec["kind"])
    if schema is not None:
        try:
            check(rec, schema[0], f"record seq {seq}: {schema[1]}", cause="so it was not written by torchcls")
        except SchemaMismatch as e:
            return str(e)
    return None


def _signer_problem(rec: dict[str, Any]) -> str | None:
    s = rec.get("signer")
    if not (isinstance(s, dict) and set(s) == {"keyid", "public_key"} and isinstance(s["keyid"], str)
            and looks_like_key_id(s["keyid"]) and isinstance(s["public_key"], str)):
        return f"record seq {rec['seq']}: a signed record must name its signer {{keyid, public_key}}"
    if "hmac" in rec:
        return f"record seq {rec['seq']}: a record is signed one way, not with both a key pair and an HMAC"
    return None


def _is_hex64(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and set(v) <= _HEX


@dataclass
class Tail:
    """The end of the log, as an append needs it: the last complete record, and where a torn last line
    starts (it is cut off before the next record is written) or whether the last record only lost its
    newline."""

    last: dict[str, Any] | None
    torn_at: int | None = None
    needs_newline: bool = False


def read_tail(f: IO[bytes], name: str) -> Tail:
    """Reads at most two lines' worth from the end (never the whole log). ValueError when the end of the
    log is not a record: an edited log takes no append until it is looked at."""
    size = f.seek(0, 2)
    start = max(0, size - 2 * (MAX_LINE_BYTES + 2))
    f.seek(start)
    block = f.read()
    cut = block.rfind(b"\n") + 1  # where the last, unterminated part starts
    if cut == 0 and start > 0:
        raise ValueError(f"{name}: its last line is longer than any record")
    body, rest = block[:cut], block[cut:]
    if rest:
        entry = parse_line(0, rest)
        if entry.record is not None:
            return Tail(entry.record, needs_newline=True)  # a complete record that lost only its newline
        if not entry.torn:
            raise ValueError(f"{name}: its last line is not a record ({entry.problem})")
    if not body:
        return Tail(None, start + cut if rest else None)
    begin = body.rfind(b"\n", 0, len(body) - 1) + 1
    if begin == 0 and start > 0:
        raise ValueError(f"{name}: its last line is longer than any record")
    entry = parse_line(0, body[begin:])
    if entry.record is None:
        raise ValueError(f"{name}: its last line is not a record ({entry.problem})")
    return Tail(entry.record, start + cut if rest else None)
