"""Signing keys: a private key signs, anyone holding the public key verifies, nobody else can sign.

Ed25519 (the default) or ECDSA P-256 (the curve OpenSSF model_signing's `key` mode and cosign use),
through the `cryptography` package. A private key is a PEM file (PKCS#8, mode 0600) that only the
signer holds, outside the run and log directories; its public key is a PEM file (SubjectPublicKeyInfo)
given to verifiers. A key is named by its key id, "sha256:" + the SHA-256 of the public key's DER
SubjectPublicKeyInfo; the short form (its first 16 hex digits) is for display only.

Keys are data: a policy or a verifier names trusted keys by key id or by public key file, never by code.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.io_files import read_bytes

SIGNING_KEY_ENV = "TORCHCLS_SIGNING_KEY"  # the private key file, for commands without --signing-key-file
TRUSTED_KEYS_ENV = "TORCHCLS_TRUSTED_KEYS"  # public key files (os.pathsep-separated) that verify and loaders trust
MAX_KEY_FILE_BYTES = 64 << 10  # a PEM key is under 1 KiB: a larger "key" file is refused before it is read
ALGORITHMS = ("ed25519", "ecdsa-p256")
PRIVATE_NAME, PUBLIC_NAME = "signing-key.pem", "signing-key.pub.pem"


def key_id(public_der: bytes) -> str:
    return "sha256:" + hashlib.sha256(public_der).hexdigest()


def short(keyid: str) -> str:
    return keyid.removeprefix("sha256:")[:16]


def looks_like_key_id(text: str) -> bool:
    hexpart = text.removeprefix("sha256:")
    return text.startswith("sha256:") and len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)


def _crypto():
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    return hashes, serialization, ec, ed25519


def public_der(public_key: Any) -> bytes:
    _, serialization, _, _ = _crypto()
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _check_type(key: Any, origin: str) -> None:
    """Only Ed25519 and ECDSA P-256: an RSA or other-curve key is refused, not half-supported."""
    _, _, ec, ed25519 = _crypto()
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        return
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)) and \
            isinstance(key.curve, ec.SECP256R1):
        return
    raise UserError(f"{origin}: a {type(key).__name__} key; torchcls signs with Ed25519 or ECDSA P-256 keys "
                    "(make one with `torchcls governance keygen`)")


@dataclass(frozen=True)
class Signer:
    """A private key loaded for signing; `keyid` and `public_der` name and carry its public half."""

    key: Any
    keyid: str
    public_der: bytes

    def sign(self, data: bytes) -> bytes:
        hashes, _, ec, ed25519 = _crypto()
        if isinstance(self.key, ed25519.Ed25519PrivateKey):
            return self.key.sign(data)
        return self.key.sign(data, ec.ECDSA(hashes.SHA256()))  # DER-encoded (r, s), as sigstore and in-toto use

    @property
    def public_b64(self) -> str:
        return base64.b64encode(self.public_der).decode()


def verify_signature(public_key: Any, signature: bytes, data: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature

    hashes, _, ec, ed25519 = _crypto()
    try:
        if isinstance(public_key, ed25519.Ed25519PublicKey):
            public_key.verify(signature, data)
        else:
            public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


def public_key_from_der(der: bytes, origin: str) -> Any:
    """A public key carried in a record (base64 DER); refused unless it is one of the two key types."""
    _, serialization, _, _ = _crypto()
    try:
        key = serialization.load_der_public_key(der)
    except (ValueError, TypeError) as e:
        raise UserError(f"{origin}: not a DER public key ({e})") from None
    _check_type(key, origin)
    return key


def _read_key_file(path: Path, what: str) -> bytes:
    if not path.exists():
        raise UserError(f"{what} {path} does not exist")
    return read_bytes(path, max_bytes=MAX_KEY_FILE_BYTES, what=what)  # a regular file, not a FIFO; bounded


def load_public_key(path: str | Path) -> tuple[str, Any]:
    """(key id, public key) from a PEM public key file (`--public-key`)."""
    path = Path(path)
    _, serialization, _, _ = _crypto()
    try:
        key = serialization.load_pem_public_key(_read_key_file(path, "public key"))
    except (ValueError, TypeError):
        raise UserError(f"public key {path}: not a PEM public key (pass the .pub.pem file written by "
                        "`torchcls governance keygen`, never the private key)") from None
    _check_type(key, f"public key {path}")
    return key_id(public_der(key)), key


def load_signer(path: str | Path, near: list[Path] = ()) -> Signer:
    """The private key in `path`; refused when others may read it, or when it lies in a directory in
    `near` (the run's, the log's): a key stored beside what it signs protects nothing."""
    path = Path(path)
    for d in near:
        if path.resolve().is_relative_to(Path(d).resolve()):
            raise UserError(f"signing key {path} lies in {d}: keep the private key outside the run and audit log "
                            "directories (whoever can edit the log could read the key)")
    data = _read_key_file(path, "signing key")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"signing key {path} is readable by other users (mode {stat.S_IMODE(path.stat().st_mode):o}): "
                        f"`chmod 600 {path}`")
    _, serialization, _, _ = _crypto()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise UserError(f"signing key {path} is encrypted; torchcls reads unencrypted PKCS#8 keys kept "
                        "with mode 0600 (or in a secrets mount)") from None
    except ValueError:
        raise UserError(f"signing key {path}: not a PEM private key (make one with `torchcls governance keygen "
                        "--out DIR`)") from None
    _check_type(key, f"signing key {path}")
    der = public_der(key.public_key())
    return Signer(key, key_id(der), der)


def signer_from(key_file: str | Path | None, near: list[Path] = ()) -> Signer | None:
    """The signing key from `key_file`, else from $TORCHCLS_SIGNING_KEY (a path), else None."""
    chosen = key_file or os.environ.get(SIGNING_KEY_ENV)
    return load_signer(chosen, near) if chosen else None


def trusted_key_files(given: list[str] | None) -> list[str]:
    """The public key files given (--public-key), else those in $TORCHCLS_TRUSTED_KEYS."""
    if given:
        return list(given)
    return [p for p in os.environ.get(TRUSTED_KEYS_ENV, "").split(os.pathsep) if p.strip()]


def keygen(out_dir: str | Path, algorithm: str = "ed25519") -> tuple[Path, Path, str]:
    """Write a new key pair into `out_dir`: (private key file (0600), public key file, key id).
    Never overwrites: an existing key file is an error (it may sign a log already)."""
    if algorithm not in ALGORITHMS:
        raise UserError(f"--algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    _, serialization, ec, ed25519 = _crypto()
    key = ed25519.Ed25519PrivateKey.generate() if algorithm == "ed25519" else ec.generate_private_key(ec.SECP256R1())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    private, public = out / PRIVATE_NAME, out / PUBLIC_NAME
    for f in (private, public):
        if f.exists():
            raise UserError(f"{f} exists: keygen never overwrites a key (it may have signed a log); use another --out")
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from creation, never wider
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public, key_id(public_der(key.public_key()))
