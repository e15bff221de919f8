"""What an artifact carries of its lineage, and the checks made before it is loaded.

Checkpoints (safetensors) carry the lineage in their metadata under `torchcls.lineage`, written when
they are saved; any other file (an AOTInductor package, a .pte, an .onnx) gets a sidecar
`<file>.lineage.json`, written when governance registers it (governance/artifacts.py). Before an
artifact is loaded, `predict`, `serve` and `load_artifact` check here that its digest is the one
registered (`check_pinned_sha256`) and that its run's policy lets predictions leave
(`refuse_forbidden_predictions`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from typing_extensions import NotRequired, TypedDict

from torchcls.bounded_json import JsonBounds, NotJson, load_bounded
from torchcls.checkpoint.files import atomic_write, resolve_checkpoint
from torchcls.checkpoint.safetensors_bounds import METADATA, check_safetensors_header
from torchcls.errors import UserError
from torchcls.io_files import read_bytes, regular_path
from torchcls.provenance.digest import looks_like_sha256, sha256_file
from torchcls.provenance.lineage import AuditLog, record_hash
from torchcls.typed_json import NonNegative, check, sha256_type

LINEAGE_KEY = "torchcls.lineage"
SIDECAR_BYTES = 1 << 20  # a sidecar is a JSON object of a few hundred bytes
# A lineage (sidecar, lineage.json, or a checkpoint's torchcls.lineage metadata value): run id, audit log, policy,
# outputs, chain head, artifact id: a few dozen values. Paths are strings of at most 4,096 characters.
LINEAGE_BOUNDS = JsonBounds(max_bytes=SIDECAR_BYTES, max_values=10_000, max_depth=8, max_str=4096)


class Pin(TypedDict):
    """An audit record's hash kept outside the log (governance/anchors.py)."""

    seq: NonNegative
    hash: sha256_type()


class PolicyRef(TypedDict):
    name: str
    file: str


class Lineage(TypedDict):
    """Every lineage torchcls writes (governance/run.py: checkpoints and lineage.json; artifacts.py: sidecars),
    typed here once: predict, serve, export and verify index these fields, so a value of another type (a
    received file's `"outputs": []`, `"seq": [1]`) is refused where the bytes are parsed, not met as a
    TypeError deep in a command. Every key is optional: older lineages and hand-made sidecars lack some,
    and consumers ask for them with .get."""

    run_id: NotRequired[str]
    audit_log: NotRequired[str]
    artifact_id: NotRequired[str]
    outputs: NotRequired[dict[str, bool]]
    chain_head: NotRequired[Pin | None]  # None: the log was empty when the run began
    policy: NotRequired[PolicyRef]
    signer: NotRequired[str]
    key_id: NotRequired[str]
    record_seq: NotRequired[NonNegative]  # lineage.json: the run record it pins
    record_hash: NotRequired[sha256_type()]


def stamp_checkpoint(path: Path, lineage: dict[str, Any]) -> None:
    """Rewrite a safetensors file with `lineage` added to its metadata (atomic; tensors unchanged).
    Only for checkpoints saved without it; a trainer stamps its checkpoints at save time."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with regular_path(path, what="checkpoint") as checked:
        with safe_open(checked, framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(checked)
    metadata[LINEAGE_KEY] = json.dumps(lineage, sort_keys=True)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".lineage.json")


def read_sidecar(path: Path) -> Lineage | None:
    """The JSON object in `path`'s sidecar; None when there is none or it is not JSON. A sidecar that is
    not a regular file (a FIFO would block the read) or is larger than any sidecar is a UserError."""
    side = sidecar(path)
    if not os.path.lexists(side):
        return None
    try:
        data = read_bytes(side, max_bytes=SIDECAR_BYTES, what="lineage sidecar")
    except OSError:
        return None
    return parse_lineage(data, str(side))


def read_lineage(path: str | Path) -> Lineage | None:
    """The lineage an artifact carries (metadata or sidecar), or None when it carries none or is unreadable.
    A lineage past LINEAGE_BOUNDS is a UserError. The artifact and its sidecar are opened only as regular files
    (UserError otherwise): `predict` and `serve` call this first, before the loader, so a FIFO named `model.pt2`
    must not block here."""
    path = Path(path)
    if os.path.lexists(sidecar(path)):
        return read_sidecar(path)
    if not os.path.lexists(path):  # (a run's checkpoint before its first save)
        return None
    try:
        with regular_path(path, what="artifact") as checked:  # (not a regular file: UserError, before any read)
            try:  # the header under torchcls's bounds (8 MiB, counted before the parse), not the library's 100 MB
                header = check_safetensors_header(checked, follow_symlinks=True)
            except UserError:  # not safetensors, or its header was damaged: the hash check or the loader says which
                return None
    except OSError:  # unreadable (a dangling link, no permission): as before, the loader says why
        return None
    raw = header.get(METADATA, {}).get(LINEAGE_KEY)
    return parse_lineage(raw.encode(), f"{path}: {LINEAGE_KEY}") if raw else None


def parse_lineage(data: bytes, where: str) -> Lineage | None:
    """A lineage's JSON under LINEAGE_BOUNDS, checked against `Lineage`: None when it is not JSON (as an unreadable
    lineage was always taken); past a bound (values, nesting, string length), or not a lineage's shape, a UserError
    naming `where` (and the field)."""
    try:
        found = load_bounded(data, LINEAGE_BOUNDS, where)
    except NotJson:
        return None
    return check_lineage(found, where)


def check_lineage(value: Any, where: str) -> Lineage:
    """`value` (parsed from `where`) when it has a lineage's shape, else a UserError naming the field."""
    return check(value, Lineage, where, hint="its lineage cannot be used: take the file again from where it was "
                                             "made (a checkpoint's run, or `torchcls export`)")


def refuse_forbidden_predictions(artifact: str | Path, command: str) -> None:
    """`predict` and `serve`: refuse an artifact whose run's policy sets [outputs] predictions = false."""
    path = Path(artifact)
    if path.is_dir():
        path = resolve_checkpoint(path)
    lineage = read_lineage(path) or {}
    if outputs_allowed(path)["predictions"]:
        return
    policy = lineage.get("policy")
    named = f"policy '{policy['name']}' ({policy['file']})" if policy else "its policy"
    raise UserError(f"torchcls {command} refused: {artifact} was built by run {lineage.get('run_id')} under {named}, "
                    "which sets [outputs] predictions = false: this model's predictions may not leave the run")


def check_pinned_sha256(path: str | Path, expected: str | None) -> None:
    """Before loading (a .pt2 is native code: it runs when loaded): the file's SHA-256 must be `expected`,
    or, when none is given, the digest governance registered for it (its sidecar's audit record)."""
    path = Path(path)
    if path.is_dir():
        path = resolve_checkpoint(path)
    if expected is not None:
        if not looks_like_sha256(expected):
            raise UserError(f"--expect-sha256 {expected!r}: not a SHA-256 hex digest (64 hex digits)")
        want, where = expected.removeprefix("sha256:").lower(), "the expected (--expect-sha256)"
    else:
        registered = registered_sha256(path)
        if registered is None:
            return
        want, where = registered
    got = sha256_file(path)
    if got != want:
        raise UserError(f"{path}: its SHA-256 {got[:16]}… differs from {where} {want[:16]}…: refusing to load it "
                        "(the file changed; a .pt2 would run its native code when loaded)")


def registered_sha256(path: Path) -> tuple[str, str] | None:
    """(digest, where) registered for an exported artifact by `register_artifact`, or None."""
    lineage = read_sidecar(path) or {}
    log = Path(str(lineage.get("audit_log", "")))
    if not lineage.get("artifact_id") or not log.is_file():
        return None
    for _, rec, _ in AuditLog(log).records():
        if rec and rec.get("kind") == "artifact" and rec.get("artifact_id") == lineage["artifact_id"] \
                and rec.get("hash") == record_hash(rec):
            return rec["sha256"], f"the digest registered in {log} (seq {rec['seq']})"
    return None


def outputs_allowed(artifact: str | Path) -> dict[str, bool]:
    """What the policy of the run that built `artifact` lets leave it (sample_images, embeddings,
    predictions); all True for artifacts built without a policy. For serve/export code to consult."""
    lineage = read_lineage(artifact) or {}
    return {"sample_images": True, "embeddings": True, "predictions": True, **lineage.get("outputs", {})}
