"""Whether a `.pt2` may be loaded: an explicit trust decision, secure by default.

An AOTInductor package is a shared library: loading it runs its constructors before any metadata
is read, so a `.pt2` from elsewhere is code, as a pickle is. It is loaded only when one of these holds:

1. its SHA-256 equals `--expect-sha256` (the digest its publisher gave you);
2. `torchcls export` on this machine published a file with this digest (the export record below:
   your own export -> serve path needs no flag);
3. its in-toto attestation (`<file>.intoto.jsonl`, written by an export signed with a key pair) is
   signed by a public key you trust (TORCHCLS_TRUSTED_KEYS: public key files) and names this digest;
4. its registration in the audit log verifies under a key you trust: a public key in
   TORCHCLS_TRUSTED_KEYS, or the legacy HMAC audit key in TORCHCLS_AUDIT_KEY (the loaders, `predict`,
   `serve` and load_artifact, read keys from the environment only; the flags belong to the commands
   that write or verify the log): the sidecar's artifact record holds this digest, every line of the
   log is an intact record signed by a trusted key, and the sidecar's pin matches;
5. the user says so: `--trust-artifact`.

Why an attestation or a registration counts only under a key you trust: without one, an artifact,
its sidecar and an audit log can be forged together (the chain is only a hash chain; a signature
under the forger's own key proves only that the forger signed it), so a run dir sent by someone
else would vouch for itself. The export record lives outside every run dir (TORCHCLS_EXPORT_RECORD,
default $XDG_STATE_HOME/torchcls/exports.jsonl), where a run dir that arrives from elsewhere cannot add to it.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.io_files import open_regular, read_bytes
from torchcls.provenance.attestation import attestation_path, verify_attestation
from torchcls.provenance.digest import looks_like_sha256, sha256_file
from torchcls.provenance.keys import KEY_ENV
from torchcls.provenance.lineage import AuditLog, record_hash
from torchcls.provenance.records import MAX_LINE_BYTES
from torchcls.provenance.sidecars import LINEAGE_BOUNDS, sidecar
from torchcls.provenance.signatures import scan_log, trusted_from
from torchcls.provenance.signing import TRUSTED_KEYS_ENV, load_public_key, trusted_key_files

RECORD_ENV = "TORCHCLS_EXPORT_RECORD"
TRUST_FLAG = "--trust-artifact"
MAX_LINE = MAX_LINE_BYTES  # an audit record or a sidecar is a few KB
EXPORT_LINE = JsonBounds(max_bytes=MAX_LINE, max_values=64, max_depth=2, max_str=8192)  # {sha256, path, time}


@dataclass(frozen=True)
class Trust:
    sha256: str
    reason: str  # why the file may be loaded, for the log line


def export_record_path() -> Path:
    if os.environ.get(RECORD_ENV):
        return Path(os.environ[RECORD_ENV])
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "torchcls" / "exports.jsonl"


def record_export(path: str | Path, digest: str) -> None:
    """`torchcls export`: remember the digest of an artifact it published (`digest`, taken before it was
    published under `path`), so that loading it on this machine needs no flag."""
    record = export_record_path()
    record.parent.mkdir(parents=True, exist_ok=True)
    entry = {"sha256": digest, "path": str(Path(path).resolve()),
             "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    with open(record, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # parallel exports append whole lines
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def _exported_here(digest: str) -> str | None:
    record = export_record_path()
    if not record.exists():
        return None
    with open_regular(record, "r", what="export record", errors="replace") as f:  # (a FIFO would block)
        for line in f:
            try:
                entry = load_bounded(line, EXPORT_LINE, str(record))
            except UserError:
                continue
            if isinstance(entry, dict) and entry.get("sha256") == digest:
                return f"published by torchcls export on this machine ({entry.get('time')}, recorded in {record})"
    return None


def _registered(path: Path, digest: str) -> tuple[str | None, str]:
    """(reason it verifies, None) or (None, why it does not). The sidecar and the log it names come with
    the file, so they are read only as far as needed: the key is checked before the log is opened, and
    no line of it is read whole beyond MAX_LINE."""
    side = sidecar(path)
    try:
        lineage = load_bounded(_read_small(side), LINEAGE_BOUNDS, str(side))
        log = AuditLog(Path(str(lineage["audit_log"])))
        artifact_id, pin = lineage["artifact_id"], dict(lineage["chain_head"])
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None, f"no readable registration ({side.name})"
    if not log.path.is_file():
        return None, f"its registration names {log.path}, which does not exist"
    trusted = trusted_from(None, None, near=[log.path.parent])
    if not trusted.any():
        return None, (f"its registration names the audit log {log.path}, but no audit key is configured ({KEY_ENV}, "
                      f"or public keys in {TRUSTED_KEYS_ENV}): without one a registration can be forged along with "
                      "the file")
    long_line = _first_long_line(log.path)
    if long_line is not None:
        return None, f"line {long_line} of its audit log {log.path} is longer than any record ({MAX_LINE} bytes)"
    found: list[dict] = []  # the last artifact record of this id: the one record kept while the log streams past

    def see(rec: dict) -> None:
        if rec["kind"] == "artifact" and rec.get("artifact_id") == artifact_id:
            found[:] = [rec]

    with log.open() as f:
        scan = scan_log(f, trusted, see)
    mine = found[-1] if found else None
    if mine is None or mine["hash"] != record_hash(mine) or pin.get("hash") != mine["hash"]:
        return None, f"its record in {log.path} is missing or does not match the sidecar's pin"
    if mine.get("sha256") != digest:
        return None, f"its SHA-256 {digest[:16]}… differs from the one registered in {log.path}: the file changed"
    broken = [str(p) for p in scan.chain.all_problems() if not p.torn]
    broken += [f"audit log line {n}: {m}" for n, m in scan.signatures.problems]
    if broken:
        return None, f"its audit log {log.path} does not verify ({broken[0]})"
    how = "signed with the configured audit key" if "signer" not in mine else \
        f"signed by trusted key sha256:{mine['signer']['keyid'][7:23]}…"
    return f"registered in {log.path} (seq {mine['seq']}), {how}", ""


def _attested(path: Path, digest: str) -> tuple[str | None, str]:
    """(reason, None) when a trusted public key signed an in-toto statement naming `digest`."""
    if not attestation_path(path).exists():
        return None, ""
    public = dict(load_public_key(f) for f in trusted_key_files(None))
    ok, detail = verify_attestation(path, digest, public)
    return (detail, "") if ok else (None, detail)


def _read_small(path: Path) -> str:
    try:
        return read_bytes(path, max_bytes=MAX_LINE, what="lineage sidecar").decode()
    except UserError as e:  # not a regular file (a FIFO would block), or larger than a sidecar
        raise ValueError(str(e)) from None


def _first_long_line(path: Path) -> int | None:
    """The number of the first line longer than MAX_LINE, read in bounded pieces; None when there is none."""
    with open_regular(path, what="audit log") as f:
        for n, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), start=1):
            if len(line) > MAX_LINE:
                return n
    return None


def decide(path: str | Path, expect_sha256: str | None = None, trust: bool = False,
           digest: str | None = None) -> Trust:
    """The trust decision for loading native code from `path`; a UserError naming the ways to trust it otherwise.
    `digest`: the SHA-256 of the bytes that will be loaded, when the caller took it (else `path` is hashed: a
    FIFO or a device is refused there, before a read that would block or never end)."""
    path = Path(path)
    digest = digest or sha256_file(path)
    if expect_sha256 is not None:
        if not looks_like_sha256(expect_sha256):
            raise UserError(f"--expect-sha256 {expect_sha256!r}: not a SHA-256 hex digest (64 hex digits)")
        if digest != expect_sha256.removeprefix("sha256:").lower():
            raise UserError(f"{path}: its SHA-256 {digest[:16]}… differs from --expect-sha256 "
                            f"{expect_sha256.removeprefix('sha256:')[:16]}…: refusing to load it")
        return Trust(digest, "its SHA-256 matches --expect-sha256")
    if trust:
        return Trust(digest, f"trusted by {TRUST_FLAG}")
    here = _exported_here(digest)
    if here:
        return Trust(digest, here)
    attested, why_not_attested = _attested(path, digest)
    if attested:
        return Trust(digest, attested)
    reason, why_not = _registered(path, digest)
    if reason:
        return Trust(digest, reason)
    why_not += f"; {why_not_attested}" if why_not_attested else ""
    raise UserError(f"{path}: refusing to load it: a .pt2 is native code, run as soon as it is loaded, and nothing "
                    f"vouches for this file ({why_not}; not exported on this machine). To load it, pass "
                    f"--expect-sha256 with the digest its publisher gave you (this file's is {digest}), or name the "
                    f"public key that signed it in {TRUSTED_KEYS_ENV} (or the audit key in {KEY_ENV}); or, if you "
                    f"trust the file, {TRUST_FLAG}")
