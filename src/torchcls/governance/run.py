"""A governed training run: `begin` (checks, before any data is read into a tensor), `install`
(hooks on the data path and the model), `finish` (outputs, stamps, the audit record).

train/loop.py calls exactly these three.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

from torchcls.config import Config, DataConfig
from torchcls.errors import UserError
from torchcls.governance.hooks import Hook, SampleInfo, by_stage, resolve_hooks
from torchcls.governance.integrity import check_data, describes, record_path
from torchcls.governance.lineage import AuditLog, default_audit_log, manifest_store
from torchcls.governance.manifest import BUILTIN_META, build_manifest, load_manifest, manifest_hash, save_manifest
from torchcls.governance.policy import Policy, facts_of, load_policy, violations
from torchcls.governance.vocab import RESTRICTED_BY_DEFAULT


class HookedImages:
    """An ImageSet whose `load` passes every sample through the tensor hooks (picklable for workers)."""

    def __init__(self, base, hooks: list[Hook], infos: list[SampleInfo]):
        self.base, self.hooks, self.infos = base, hooks, infos

    def load(self, i: int):
        x = self.base.load(i)
        for h in self.hooks:
            x = h.fn(x, self.infos[i])
        return x

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, name: str):
        if name in ("base", "hooks", "infos"):  # not yet set while unpickling
            raise AttributeError(name)
        return getattr(self.base, name)


class Governance:
    def __init__(self, cfg: Config, run_path: Path):
        g = cfg.governance
        self.cfg, self.run_path = cfg, run_path
        self.policy: Policy | None = load_policy(g.policy) if g.policy else None
        self.hooks = resolve_hooks(g.hooks)
        self.audit = AuditLog(g.audit_log or default_audit_log(cfg.run.out_dir)) if g.lineage else None
        self.run_id = _previous_run_id(run_path) or uuid.uuid4().hex
        self.data_config: DataConfig = cfg.data
        self.manifest: dict[str, Any] | None = None
        self.isolation_bad: list[tuple[SampleInfo, str]] = []
        self.images = None

    # --- begin: everything here happens before any sample is decoded --------------------------

    def check(self) -> None:
        g, source = self.cfg.governance, self.cfg.data.source
        manifest = load_manifest(g.data_manifest) if g.data_manifest else None
        if manifest is not None and not describes(manifest, source):
            raise UserError(f"--data-manifest {g.data_manifest} describes {manifest['tc:source']}, "
                            f"not the training data {source}")
        if self.policy is not None:
            if manifest is None and source not in BUILTIN_META:
                reasons = [f"{source}: no data manifest, so its license, jurisdiction and tags are unknown; "
                           f"create one with `torchcls data manifest {source} --license ... --jurisdiction ...` "
                           "and pass --data-manifest"]
            else:
                facts = facts_of(manifest) if manifest else facts_of(_builtin_stub(source))
                reasons = violations(self.policy, facts, g.region, {h.name for h in self.hooks})
            if reasons:
                self._refuse(reasons, "the policy forbids this run")
        if manifest is not None:
            problems = check_data(manifest)
            if problems:
                self._refuse(problems, f"the data no longer matches manifest {g.data_manifest}")
        if manifest is None and not (g.lineage or self.hooks or g.sample_grid):
            return  # governance off: nothing to hash, hook or record
        self.manifest = manifest or build_manifest(source, self.cfg.data.root)
        if self.audit is not None:
            store = manifest_store(self.audit.path)
            target = store / f"{manifest_hash(self.manifest)}.json"
            if not target.is_file():
                save_manifest(self.manifest, target)
        self.record_infos = self._record_infos()
        files = by_stage(self.hooks, "file")
        if files and self.manifest["tc:source"] not in BUILTIN_META:
            self._isolate(files)

    def _refuse(self, reasons: list[str], headline: str) -> None:
        if self.audit is not None:
            self.audit.append("refused", {"run_id": self.run_id, "run_dir": str(self.run_path.resolve()),
                                          "data": self.cfg.data.source, "region": self.cfg.governance.region,
                                          "policy_sha256": self.policy.digest if self.policy else None,
                                          "reasons": reasons})
        raise UserError(f"training refused: {headline}; no data was loaded:\n"
                        + "\n".join(f"  - {r}" for r in reasons))

    def _record_infos(self) -> list[SampleInfo]:
        m = self.manifest
        ds_tags, ds_j = set(m.get("rai:personalSensitiveInformation") or []), m.get("dpv:hasJurisdiction")
        restricted_tags = set(self.policy.restricted_tags if self.policy else RESTRICTED_BY_DEFAULT)
        infos = []
        for i, r in enumerate(m["tc:records"]):
            tags = frozenset(ds_tags | set(r.get("tags", [])))
            infos.append(SampleInfo(i, r["@id"], r["sha256"], tags, r.get("dpv:hasJurisdiction", ds_j),
                                    bool(tags & restricted_tags)))
        return infos

    def _isolate(self, hooks: list[Hook]) -> None:
        from torchcls.governance.isolate import isolate

        self.workdir = Path(tempfile.mkdtemp(prefix="torchcls-isolated-"))
        weakref.finalize(self, shutil.rmtree, str(self.workdir), True)
        csv_path, self.isolation_bad = isolate(self.manifest, self.record_infos, hooks, self.workdir,
                                               self.cfg.data.on_bad_file)
        self.data_config = dataclasses.replace(self.cfg.data, source=str(csv_path), root=None)

    # --- install: hooks on the data path and the model ------------------------------------------

    def sample_info(self, images, i: int) -> SampleInfo:
        return dataclasses.replace(self.record_infos[self._record_index(images, i)], index=i)

    def _record_index(self, images, i: int) -> int:
        if images.paths is None:  # built-in: the training split's records come first, in order
            return i
        if not hasattr(self, "_by_path"):
            recs = self.manifest["tc:records"]
            self._by_path = {str(record_path(self.manifest, r).resolve()): k for k, r in enumerate(recs)}
            self._by_sha = {}
            for k, r in enumerate(recs):
                self._by_sha.setdefault(r["sha256"], k)
        p = Path(images.paths[i])
        k = self._by_path.get(str(p.resolve()), self._by_sha.get(p.stem))
        if k is None:
            raise UserError(f"{p} is read by the run but is not in the data manifest")
        return k

    @property
    def has_model_hooks(self) -> bool:
        return bool(by_stage(self.hooks, "model"))

    def install(self, data, model):
        self.images = data.images
        tensor_hooks = by_stage(self.hooks, "tensor")
        if tensor_hooks:
            infos = [self.sample_info(data.images, i) for i in range(len(data.images))]
            hooked = HookedImages(data.images, tensor_hooks, infos)
            data.train.images = data.val.images = self.images = hooked
        for h in by_stage(self.hooks, "model"):
            model = h.fn(model)
        return model

    # --- finish: outputs, stamps, the audit record -----------------------------------------------

    def finish(self, result) -> dict[str, Any] | None:
        from torchcls.governance.finish import finish_run

        return finish_run(self, result)


def begin(cfg: Config, run_path: Path) -> Governance:
    """Check the policy and the data's integrity; raises UserError (and logs a 'refused' record) on any
    violation, before the data set is opened."""
    try:
        gov = Governance(cfg, run_path)
        gov.check()
    except UserError:
        if not cfg.run.resume:  # a bad policy, hook or manifest: leave no half-made run dir behind
            shutil.rmtree(run_path, ignore_errors=True)
        raise
    return gov


def _previous_run_id(run_path: Path) -> str | None:
    f = run_path / "lineage.json"
    return json.loads(f.read_text()).get("run_id") if f.is_file() else None


def _builtin_stub(source: str) -> dict[str, Any]:
    meta = BUILTIN_META[source]
    return {"name": meta.name, "license": meta.license, "dpv:hasJurisdiction": meta.jurisdiction,
            "rai:personalSensitiveInformation": meta.tags, "dpv:hasLegalBasis": meta.legal_basis,
            "expires": meta.expires, "tc:records": [], "tc:source": source}
