"""The legacy audit key: an optional secret that signs every audit record (HMAC-SHA256 of its hash).

Superseded by key pairs (signing.py): an HMAC proves nothing to a third party, since whoever holds
the key to check a record can also forge one. It still signs when no signing key is configured, and
logs signed with it still verify (--audit-key-file). Without a key, the hash chain shows damage and
edits by anyone who does not also recompute the chain; with one, a record can only be written,
changed or re-linked by someone who holds the key.
The key is read from a file (--audit-key-file) or the TORCHCLS_AUDIT_KEY environment variable,
never from the run or the log's directory: a key stored beside the log protects nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from torchcls.errors import UserError
from torchcls.io_files import read_bytes

MAX_KEY_BYTES = 4096  # a key is 32-64 random bytes, hex or raw: a file larger than this is not a key

KEY_ENV = "TORCHCLS_AUDIT_KEY"
MIN_KEY_BYTES = 16


def load_key(key_file: str | Path | None, near: list[Path] = ()) -> bytes | None:
    """The key from `key_file`, else from $TORCHCLS_AUDIT_KEY, else None. `near`: directories the key
    must not lie in (the audit log's, the run's)."""
    if key_file:
        path = Path(key_file)
        if not path.exists():
            raise UserError(f"--audit-key-file {path} does not exist")
        for d in near:
            if path.resolve().is_relative_to(Path(d).resolve()):
                raise UserError(f"--audit-key-file {path} lies in {d}: keep the audit key outside the run and "
                                "audit log directories (whoever can edit the log could read the key)")
        key = read_bytes(path, max_bytes=MAX_KEY_BYTES, what="audit key file").strip()
        origin = f"--audit-key-file {path}"
    elif os.environ.get(KEY_ENV):
        key, origin = os.environ[KEY_ENV].strip().encode(), KEY_ENV
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise UserError(f"{origin}: the audit key has {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes "
                        "(e.g. `openssl rand -hex 32`)")
    return key


def key_id(key: bytes) -> str:
    """A public name for the key (a MAC of a fixed label, so it reveals nothing about the key)."""
    return hmac.new(key, b"torchcls audit key id", hashlib.sha256).hexdigest()[:16]


def sign(key: bytes, record_hash: str) -> str:
    return hmac.new(key, record_hash.encode(), hashlib.sha256).hexdigest()


def signature_ok(key: bytes, record_hash: str, mac: str | None) -> bool:
    return mac is not None and hmac.compare_digest(sign(key, record_hash), str(mac))
