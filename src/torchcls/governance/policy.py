"""The policy: a TOML file saying what may be processed where and how, and what may leave a run.

    [processing]  allowed_regions = ["eu-*"]              host regions (fnmatch patterns)
    [data]        allowed_licenses, allowed_jurisdictions, mix_jurisdictions = false,
                  require_legal_basis, require_retention, max_retention_days
    [residency]   EU = ["eu-*"]                            regions where each jurisdiction's data may be processed
    [hooks]       personal = ["strip-exif", "redact-samples"]   hooks required per sensitivity tag
    [outputs]     sample_images, embeddings, predictions (true/false), restricted_tags
    [provenance]  require_signatures = true                audit records must be signed with a trusted key
                  trusted_keys = ["sha256:..."]            key ids of trusted public keys (keygen prints them)

Parsing is strict: an unknown section, key or tag is an error, because a misspelt rule
would otherwise be a rule silently not enforced.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.vocab import RESTRICTED_BY_DEFAULT, check_tags
from torchcls.provenance.digest import sha256_json
from torchcls.provenance.signing import looks_like_key_id
from torchcls.toml_files import read_toml

_SCHEMA: dict[str, dict[str, type]] = {
    "policy": {"name": str, "description": str},
    "processing": {"allowed_regions": list},
    "data": {"allowed_licenses": list, "allowed_jurisdictions": list, "mix_jurisdictions": bool,
             "require_legal_basis": bool, "require_retention": bool, "max_retention_days": int},
    "outputs": {"sample_images": bool, "embeddings": bool, "predictions": bool, "restricted_tags": list},
    "provenance": {"require_signatures": bool, "trusted_keys": list},
}


@dataclass
class Policy:
    name: str = "unnamed"
    description: str = ""
    allowed_regions: list[str] | None = None
    allowed_licenses: list[str] | None = None
    allowed_jurisdictions: list[str] | None = None
    mix_jurisdictions: bool = True
    require_legal_basis: bool = False
    require_retention: bool = False
    max_retention_days: int | None = None
    residency: dict[str, list[str]] = field(default_factory=dict)
    hooks: dict[str, list[str]] = field(default_factory=dict)
    sample_images: bool = True
    embeddings: bool = True
    predictions: bool = True
    restricted_tags: list[str] = field(default_factory=lambda: list(RESTRICTED_BY_DEFAULT))
    require_signatures: bool = False
    trusted_keys: list[str] = field(default_factory=list)  # key ids ("sha256:" + 64 hex digits): data, not code

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return sha256_json(self.to_dict())

    def outputs(self) -> dict[str, bool]:
        return {"sample_images": self.sample_images, "embeddings": self.embeddings, "predictions": self.predictions}


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    if not path.exists():  # (a FIFO or device exists: read_toml refuses it, saying what it is)
        raise UserError(f"policy file {path} does not exist")
    return policy_from_dict(read_toml(path, "policy", invalid="does not parse as TOML"), str(path))


def policy_from_dict(raw: dict[str, Any], origin: str = "policy") -> Policy:
    p = Policy()
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise UserError(f"policy {origin}: [{section}] must be a table")
        if section in ("hooks", "residency"):
            _mapping(p, section, values, origin)
            continue
        if section not in _SCHEMA:
            raise UserError(f"policy {origin}: unknown section [{section}]; known: "
                            f"{', '.join([*_SCHEMA, 'hooks', 'residency'])}")
        for key, value in values.items():
            want = _SCHEMA[section].get(key)
            if want is None:
                raise UserError(f"policy {origin}: unknown key '{key}' in [{section}]; known: "
                                f"{', '.join(_SCHEMA[section])}")
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise UserError(f"policy {origin}: [{section}] {key} must be {want.__name__}, got {value!r}")
            if want is list and not all(isinstance(v, str) for v in value):
                raise UserError(f"policy {origin}: [{section}] {key} must be a list of strings")
            setattr(p, key, value)
    check_tags(p.restricted_tags, f"policy {origin} [outputs] restricted_tags")
    bad = [k for k in p.trusted_keys if not looks_like_key_id(k)]
    if bad:
        raise UserError(f"policy {origin}: [provenance] trusted_keys {bad[0]!r} is not a key id (sha256: and 64 hex "
                        "digits, as `torchcls governance keygen` prints it)")
    return p


def _mapping(p: Policy, section: str, values: dict[str, Any], origin: str) -> None:
    for key, value in values.items():
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise UserError(f"policy {origin}: [{section}] {key} must be a list of strings, got {value!r}")
    if section == "hooks":
        check_tags(list(values), f"policy {origin} [hooks]")
    getattr(p, section).update(values)


@dataclass
class DataFacts:
    """What the policy decides on, gathered from the manifests of the data a run will read."""

    name: str
    license: str | None
    jurisdictions: set[str | None]
    tags: set[str]
    legal_basis: str | None
    expires: str | None
    created: str | None


def facts_of(manifest: dict[str, Any]) -> DataFacts:
    ds_j = manifest.get("dpv:hasJurisdiction")
    records = manifest["tc:records"]
    jurisdictions = {r.get("dpv:hasJurisdiction", ds_j) for r in records} or {ds_j}
    tags = set(manifest.get("rai:personalSensitiveInformation") or [])
    for r in records:
        tags.update(r.get("tags", []))
    return DataFacts(manifest.get("name") or manifest["tc:source"], manifest.get("license"), jurisdictions, tags,
                     manifest.get("dpv:hasLegalBasis"), manifest.get("expires"), manifest.get("dateCreated"))


def _matches(value: str | None, patterns: list[str]) -> bool:
    return value is not None and any(fnmatch.fnmatchcase(value, pat) for pat in patterns)


def violations(p: Policy, data: DataFacts, region: str | None, hooks: set[str],
               today: dt.date | None = None) -> list[str]:
    """Every rule `data` processed on a host in `region` with `hooks` installed would break."""
    today, out, name = today or dt.date.today(), [], data.name
    if p.allowed_regions is not None and not _matches(region, p.allowed_regions):
        out.append(f"host region {region!r} is not allowed (allowed: {', '.join(p.allowed_regions)})"
                   + ("; set it with --region" if region is None else ""))
    if p.allowed_licenses is not None and data.license not in p.allowed_licenses:
        out.append(f"{name}: license {data.license!r} is not allowed (allowed: {', '.join(p.allowed_licenses)})")
    if p.allowed_jurisdictions is not None:
        bad = sorted(str(j) for j in data.jurisdictions if j not in p.allowed_jurisdictions)
        if bad:
            out.append(f"{name}: data from jurisdiction(s) {', '.join(bad)} is not allowed "
                       f"(allowed: {', '.join(p.allowed_jurisdictions)})")
    if not p.mix_jurisdictions and len(data.jurisdictions) > 1:
        out.append(f"{name}: mixes data from jurisdictions {', '.join(sorted(map(str, data.jurisdictions)))}, "
                   "which the policy forbids (mix_jurisdictions = false)")
    for j in sorted(j for j in data.jurisdictions if j in p.residency):
        if not _matches(region, p.residency[j]):
            out.append(f"{name}: data from {j} may only be processed in regions {', '.join(p.residency[j])}, "
                       f"this host is {region!r}")
    if p.require_legal_basis and not data.legal_basis:
        out.append(f"{name}: the manifest states no legal basis (dpv:hasLegalBasis)")
    out += _retention(p, data, today)
    for tag in sorted(data.tags):
        missing = [h for h in p.hooks.get(tag, []) if h not in hooks]
        if missing:
            out.append(f"{name}: tag '{tag}' requires hook(s) {', '.join(missing)}, not installed "
                       f"(add them with --hooks)")
    return out


def _retention(p: Policy, data: DataFacts, today: dt.date) -> list[str]:
    if data.expires is None:
        return [f"{data.name}: the manifest states no retention date (expires)"] if p.require_retention else []
    expires = dt.date.fromisoformat(data.expires[:10])
    out = []
    if expires < today:
        out.append(f"{data.name}: retention expired on {expires} (manifest 'expires'); the data must not be used")
    if p.max_retention_days is not None and data.created:
        kept = (expires - dt.date.fromisoformat(data.created[:10])).days
        if kept > p.max_retention_days:
            out.append(f"{data.name}: retention of {kept} days exceeds the policy's {p.max_retention_days}")
    return out
