"""Who signed the audit log's records, and whether the verifier trusts them.

Trusted keys are what the verifier brings, never what the log says: public key files (--public-key,
$TORCHCLS_TRUSTED_KEYS), key ids a policy trusts ([provenance] trusted_keys: the public key is then
taken from the record, after checking that it hashes to that id), and the legacy HMAC key
(--audit-key-file, $TORCHCLS_AUDIT_KEY).

With any trusted key, or a policy that requires signatures, every record must carry a valid signature
by a trusted key: an unsigned record, one under an unknown key, or an HMAC record without the HMAC key
fails. Without one, each key-pair signature is still checked against the public key its own record
names (a record changed after signing, or a signature moved onto another record, fails), and a signed
log that turns unsigned fails (a signed log takes no unsigned append); but nothing then shows who the
signers are, so the result is "signatures not checked", never "verified".
"""

from __future__ import annotations

import base64
import binascii
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from torchcls.errors import UserError
from torchcls.provenance.keys import key_id as hmac_key_id
from torchcls.provenance.keys import load_key, signature_ok
from torchcls.provenance.records import ChainCheck, Entry, read_entries, record_hash, signed_how
from torchcls.provenance.signing import (
    key_id,
    load_public_key,
    public_der,
    public_key_from_der,
    short,
    trusted_key_files,
    verify_signature,
)


@dataclass
class Trusted:
    public: dict[str, Any] = field(default_factory=dict)  # key id -> public key (from files)
    ids: frozenset[str] = frozenset()  # key ids a policy trusts
    hmac: bytes | None = None  # the legacy audit key
    required: bool = False  # a policy requires signatures

    def any(self) -> bool:
        return bool(self.public or self.ids) or self.hmac is not None

    @property
    def strict(self) -> bool:
        return self.any() or self.required

    def trusts(self, keyid: str) -> bool:
        return keyid in self.public or keyid in self.ids

    def names(self) -> str:
        ids = sorted({*self.public, *self.ids})
        return ", ".join(short(k) for k in ids) or "no key pair"


@dataclass
class SignatureReport:
    problems: list[tuple[int, str]] = field(default_factory=list)  # (line, what is wrong)
    signers: Counter = field(default_factory=Counter)  # key id -> records it signed
    hmac_signers: Counter = field(default_factory=Counter)
    unsigned: int = 0

    def summary(self) -> str:
        parts = [f"unsigned: {self.unsigned} records"] if self.unsigned else []
        if self.signers:
            parts.append(f"signed with key pairs by {len(self.signers)} signer(s): "
                         + ", ".join(f"sha256:{short(k)}… ({n} records)" for k, n in sorted(self.signers.items())))
        if self.hmac_signers:
            parts.append("HMAC-signed: " + ", ".join(f"key id {k} ({n} records)"
                                                     for k, n in sorted(self.hmac_signers.items())))
        return "; ".join(parts) or "no records"


def check_signatures(entries: Iterable[Entry], trusted: Trusted) -> SignatureReport:
    """Every record's signature against `trusted`; lines that are not records are check_chain's to report."""
    report, seen_signed = SignatureReport(), False
    for e in entries:
        rec = e.record
        if rec is None:
            continue
        how = signed_how(rec)
        if how == "key pair":
            report.signers[rec["signer"]["keyid"]] += 1
            problem = _key_pair_problem(e, trusted)
        elif how == "hmac":
            report.hmac_signers[rec["key_id"]] += 1
            problem = _hmac_problem(rec, trusted)
        else:
            report.unsigned += 1
            problem = (f"record seq {rec['seq']} is not signed: written without a signing key (before one was set "
                       "up: start a new --audit-log when introducing a key) or re-written by someone without it"
                       if trusted.strict else f"record seq {rec['seq']} is unsigned after signed records (its "
                       "signature was removed: a signed log takes no unsigned record)" if seen_signed else None)
        seen_signed = seen_signed or how is not None
        if problem:
            report.problems.append((e.line, problem))
    return report


def _key_pair_problem(e: Entry, trusted: Trusted) -> str | None:
    rec, seq = e.record, e.record["seq"]
    keyid = rec["signer"]["keyid"]
    try:
        public = public_key_from_der(base64.b64decode(rec["signer"]["public_key"], validate=True), "signer")
    except (UserError, binascii.Error, ValueError):
        return f"record seq {seq}: the public key it names cannot be read"
    if key_id(public_der(public)) != keyid:
        return f"record seq {seq}: the public key it carries is not key id {short(keyid)}… (a forged signer)"
    if not all(verify_signature(public, sig, e.envelope.signed_bytes()) for _, sig in e.envelope.signatures):
        return (f"record seq {seq}: its signature does not verify under its key sha256:{short(keyid)}…: the record "
                "was changed after it was signed, or the signature was taken from another record")
    if trusted.strict and not trusted.trusts(keyid):
        return (f"record seq {seq} is signed by key sha256:{short(keyid)}…, which is not a trusted key (trusted: "
                f"{trusted.names()}; add its public key with --public-key or to [provenance] trusted_keys)")
    return None


def _hmac_problem(rec: dict[str, Any], trusted: Trusted) -> str | None:
    seq = rec["seq"]
    if trusted.hmac is None:
        return None if not trusted.strict else (
            f"record seq {seq} is HMAC-signed (key id {rec['key_id']}), and no HMAC audit key was given to check it "
            "(--audit-key-file or TORCHCLS_AUDIT_KEY)")
    mine = hmac_key_id(trusted.hmac)
    if rec["key_id"] != mine:
        return f"record seq {seq} is signed with key id {rec['key_id']}, the given key is {mine}"
    if not signature_ok(trusted.hmac, record_hash(rec), rec["hmac"]):
        return (f"record seq {seq}: its signature does not match: the record was changed or re-linked by someone "
                "without the key")
    return None


def trusted_from(key_file: str | None = None, public_keys: list[str] | None = None, policy=None,
                 near: list = ()) -> Trusted:
    """What the verifier trusts: public key files (`public_keys`, else $TORCHCLS_TRUSTED_KEYS), the policy's
    [provenance] (a policy.Policy, or None), the legacy HMAC key (`key_file`, else $TORCHCLS_AUDIT_KEY)."""
    public = dict(load_public_key(f) for f in trusted_key_files(public_keys))
    return Trusted(public=public, ids=frozenset(policy.trusted_keys if policy else ()),
                   hmac=load_key(key_file, near=near), required=bool(policy and policy.require_signatures))


def check_signing(policy, audit, origin: str) -> None:
    """At the start of a run: a policy whose [provenance] requires signatures needs a signing key (the
    legacy HMAC key counts only while the policy trusts no key ids), and one of its trusted keys."""
    if not policy.require_signatures and not policy.trusted_keys:
        return
    signer = audit.signer if audit is not None else None
    if signer is None and not (audit is not None and audit.key is not None and not policy.trusted_keys):
        if policy.require_signatures:
            raise UserError(f"policy {origin} requires signed audit records ([provenance] require_signatures): "
                            "pass --signing-key-file (or set TORCHCLS_SIGNING_KEY) with a key from "
                            "`torchcls governance keygen`, and keep --lineage on")
        return
    if signer is not None and policy.trusted_keys and signer.keyid not in policy.trusted_keys:
        raise UserError(f"policy {origin} trusts keys {', '.join(short(k) for k in policy.trusted_keys)}; the signing "
                        f"key {signer.keyid} is not one of them ([provenance] trusted_keys)")


@dataclass
class LogScan:
    """One pass over a log: its chain and its signatures, as running state (no record is kept)."""

    chain: ChainCheck
    signatures: SignatureReport


def scan_log(f: IO[bytes], trusted: Trusted, see: Callable[[dict[str, Any]], None] | None = None) -> LogScan:
    """Read the log `f` once, line by bounded line, checking its chain and signatures as it goes; `see` is
    shown each record (a search that keeps the few it needs). Memory: one line, not the log."""
    chain = ChainCheck()

    def fed() -> Iterator[Entry]:
        for e in read_entries(f):
            chain.feed(e)
            if see is not None and e.record is not None:
                see(e.record)
            yield e

    return LogScan(chain, check_signatures(fed(), trusted))
