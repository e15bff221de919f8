"""Data governance: manifests, policies, processing hooks, the hash-chained audit log, verification.

Light to import: submodules are loaded on first use.
"""

from __future__ import annotations

from torchcls.lazy import lazy_api

_API = {
    "begin": "torchcls.governance.run",
    "Governance": "torchcls.governance.run",
    "build_manifest": "torchcls.governance.manifest",
    "load_manifest": "torchcls.governance.manifest",
    "DatasetMeta": "torchcls.governance.manifest",
    "load_policy": "torchcls.governance.policy",
    "hook": "torchcls.governance.hooks",
    "register_hook": "torchcls.governance.hooks",
    "available_hooks": "torchcls.governance.hooks",
    "SampleInfo": "torchcls.governance.hooks",
    "OutputItem": "torchcls.governance.hooks",
    "AuditLog": "torchcls.provenance.lineage",
    "register_artifact": "torchcls.governance.artifacts",
    "read_lineage": "torchcls.provenance.sidecars",
    "outputs_allowed": "torchcls.provenance.sidecars",
    "verify": "torchcls.governance.verification",
    "file_lineage": "torchcls.governance.query",
    "write_manifest": "torchcls.governance.cli_api",
}

__all__ = list(_API)

__getattr__ = lazy_api(globals(), _API)
