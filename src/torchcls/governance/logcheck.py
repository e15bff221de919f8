"""The result of a verification, and the checks of an audit log on its own: its lines, its hash chain,
its signatures (`torchcls governance verify-log`, and the first part of `torchcls verify`).

A result has one of three statuses, and only one of them claims provenance:
- "verified" (CLI exit 0, last line PASS): every check passed and every record's signature verified
  under a key the verifier trusts (a public key it was given, a key id its policy lists, or the legacy
  HMAC key);
- "unverified" (exit 3, last line UNVERIFIED): nothing failed, the log is intact as a file and a
  chain, but no trusted key was given (or the log is unsigned), so who wrote it is unproven;
- "failed" (exit 1, last line FAIL): a check failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchcls.provenance.lineage import AuditLog
from torchcls.provenance.signatures import LogScan, SignatureReport, Trusted, scan_log, trusted_from
from torchcls.provenance.signing import short

EXIT_CODES = {"verified": 0, "failed": 1, "unverified": 3}
HMAC_NOTE = ("HMAC: shows only that a holder of this secret key wrote it; anyone who can check it can also forge "
             "it. Sign with a key pair (torchcls governance keygen) to prove it to others")


@dataclass
class Check:
    name: str
    status: str  # pass, fail, skip
    detail: str


@dataclass
class VerifyResult:
    artifact: str
    checks: list[Check] = field(default_factory=list)
    provenance: bool = False  # every record's signature verified under a trusted key
    unproven: str = ""  # why provenance is unproven, when nothing failed

    @property
    def status(self) -> str:
        if any(c.status == "fail" for c in self.checks):
            return "failed"
        return "verified" if self.provenance else "unverified"

    @property
    def ok(self) -> bool:
        return self.status == "verified"

    def add(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks.append(Check(name, "skip" if ok is None else "pass" if ok else "fail", detail))

    def to_dict(self) -> dict[str, Any]:
        return {"artifact": self.artifact, "ok": self.ok, "status": self.status,
                "provenance": "verified" if self.provenance else "unproven",
                **({"unproven_because": self.unproven} if self.status == "unverified" else {}),
                "checks": [c.__dict__ for c in self.checks]}


def listed(items: list, more: int = 0) -> str:
    """The first five of `items`, and how many more (`more`: those not even kept)."""
    more += max(0, len(items) - 5)
    return "; ".join(str(p) for p in items[:5]) + (f" (+{more} more)" if more else "")


def check_log(res: VerifyResult, log: AuditLog, scan: LogScan, trusted: Trusted,
              lineage: dict[str, Any] | None = None) -> None:
    """The log's lines and chain, then its signatures, added to `res`."""
    torn = [p for p in scan.chain.problems if p.torn]
    problems = [p for p in scan.chain.problems if not p.torn]
    res.add("audit log chain", not (problems or scan.chain.dropped), (
        f"{log.path}: {scan.chain.records} records, every line a record, chain intact"
        if not problems else listed(problems, scan.chain.dropped))
            + ("; " + listed(torn) + " (reported, not failed)" if torn else ""))
    _check_signatures(res, scan.signatures, trusted, lineage)


def _check_signatures(res: VerifyResult, report: SignatureReport, trusted: Trusted,
                      lineage: dict[str, Any] | None) -> None:
    problems = [f"audit log line {n}: {m}" for n, m in report.problems]
    if trusted.any():
        hmac_only = trusted.hmac is not None and not report.signers
        res.add("audit log signatures", not problems, listed(problems) if problems else
                f"every record signed by a trusted key ({report.summary()})" + (f"; {HMAC_NOTE}" if hmac_only else ""))
        res.provenance = not problems and bool(report.signers or report.hmac_signers)
        res.unproven = "" if res.provenance else "the log holds no signed record"
        return
    if trusted.required:
        problems.insert(0, "the policy requires signatures ([provenance] require_signatures), but no trusted key was "
                           "given (--public-key FILE, [provenance] trusted_keys, or --audit-key-file)")
    named = (lineage or {}).get("signer") or (lineage or {}).get("key_id")
    if named and not (report.signers or report.hmac_signers):
        problems.append(f"{res.artifact}'s lineage says its run signed the log (key {short(named)}), but no record "
                        "in it is signed: the signatures were removed")
    res.unproven = (f"the log is intact as a file and a hash chain, but {report.summary()}; signatures not checked "
                    "against a trusted key: none was given (--public-key FILE, or a --policy whose [provenance] lists "
                    "trusted_keys), so who wrote it is unproven")
    hint = "pass --public-key FILE" + (" or, for HMAC records, --audit-key-file" if report.hmac_signers else "")
    res.add("audit log signatures", False if problems else None, listed(problems) if problems else
            f"{report.summary()}; signatures not checked against a trusted key (none given: {hint})")


def verify_log(path: str | Path, key_file: str | None = None, public_keys: list[str] | None = None,
               policy: str | None = None) -> VerifyResult:
    """`torchcls governance verify-log`: an audit log's lines, chain and signatures, without an artifact."""
    from torchcls.governance.policy import load_policy

    log = AuditLog(path)
    trusted = trusted_from(key_file, public_keys, load_policy(policy) if policy else None, near=[log.path.parent])
    res = VerifyResult(str(log.path))
    with log.open() as f:
        check_log(res, log, scan_log(f, trusted), trusted)
    return res
