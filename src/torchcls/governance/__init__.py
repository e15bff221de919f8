"""Data governance: manifests, policies, processing hooks, the hash-chained audit log, verification.

Light to import: submodules are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "begin": "torchcls.governance.run",
    "Governance": "torchcls.governance.run",
    "build_manifest": "torchcls.governance.manifest",
    "load_manifest": "torchcls.governance.manifest",
    "DatasetMeta": "torchcls.governance.manifest",
    "load_policy": "torchcls.governance.policy",
    "hook": "torchcls.governance.hooks",
    "SampleInfo": "torchcls.governance.hooks",
    "OutputItem": "torchcls.governance.hooks",
    "AuditLog": "torchcls.governance.lineage",
    "register_artifact": "torchcls.governance.artifacts",
    "read_lineage": "torchcls.governance.artifacts",
    "outputs_allowed": "torchcls.governance.artifacts",
    "verify": "torchcls.governance.verification",
    "file_lineage": "torchcls.governance.query",
    "write_manifest": "torchcls.governance.cli_api",
}

__all__ = list(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'torchcls.governance' has no attribute {name!r}")
