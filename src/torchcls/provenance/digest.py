"""Hashing primitives shared by manifests, the audit log and artifact checks.

The Merkle tree uses RFC 6962's domain separation (Certificate Transparency): leaves and inner
nodes are hashed with different one-byte prefixes, so a leaf can never be passed off as a node.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

from torchcls.io_files import open_regular

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of the regular file `path` (a FIFO or a device is refused: its hash would never end)."""
    with open_regular(path, what="file to hash") as f:
        return sha256_stream(f)


def sha256_stream(f: BinaryIO, copy_to: BinaryIO | None = None) -> str:
    """The SHA-256 of what is left to read in `f`; each piece is also written to `copy_to` when given, so
    that the copy holds exactly the bytes hashed."""
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace. What every hash in governance is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_json(obj: Any) -> str:
    return sha256_bytes(canonical_json(obj))


def merkle_root(leaves: list[bytes]) -> str:
    """RFC 6962 Merkle tree hash of `leaves` (each the canonical bytes of one record)."""
    if not leaves:
        return hashlib.sha256(b"").hexdigest()
    level = [hashlib.sha256(b"\x00" + leaf).digest() for leaf in leaves]
    while len(level) > 1:
        nxt = [hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:  # an odd node is promoted unchanged to the next level
            nxt.append(level[-1])
        level = nxt
    return level[0].hex()


def looks_like_sha256(text: str) -> bool:
    t = text.removeprefix("sha256:")
    return len(t) == 64 and all(c in "0123456789abcdef" for c in t.lower())
