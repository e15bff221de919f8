"""A governed training run, one object from its start to its end. The trainer announces its start and its
finish (torchcls.events: `on_run_started`, `on_run_finished` below) and calls the guard's methods between:

- `begin(cfg, run_path)`: the policy and the data's integrity are checked before any data is read
  into a tensor; the lineage id is known from here on, so checkpoints carry it from their first
  save (`Governance.checkpoint_metadata()`), and nothing is rewritten after training.
- `install(data, model)`: hooks on the data path and the model.
- `finish(result)`: sample outputs through the hooks, the run's artifacts hashed, one `run` record
  appended to the audit log, lineage.json and governance.json written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

from torchcls import run_files
from torchcls.config import Config, DataConfig
from torchcls.errors import UserError
from torchcls.events import RunFinished, RunStarted
from torchcls.governance.environment import code_version, package_versions
from torchcls.governance.hashcache import CACHE_FILE, HashCache
from torchcls.governance.hooks import Hook, HookedImages, SampleInfo, by_stage, resolve_hooks
from torchcls.governance.integrity import check_data, describes, record_path
from torchcls.governance.manifest import (
    BUILTIN_META,
    MANIFEST_HASH_VERSION,
    build_manifest,
    load_manifest,
    manifest_hash,
)
from torchcls.governance.outputs import redact_skipped, sample_grid
from torchcls.governance.policy import Policy, facts_of, load_policy, violations
from torchcls.governance.store import store_built, store_given
from torchcls.governance.vocab import RESTRICTED_BY_DEFAULT
from torchcls.provenance.digest import sha256_file
from torchcls.provenance.keys import key_id, load_key
from torchcls.provenance.lineage import STORE_DIR, AuditLog, default_audit_log, manifest_store
from torchcls.provenance.sidecars import LINEAGE_KEY, SIDECAR_BYTES, parse_lineage, read_lineage, stamp_checkpoint
from torchcls.provenance.signatures import check_signing
from torchcls.provenance.signing import signer_from
from torchcls.run_files import write_text_atomic


class Governance:
    def __init__(self, cfg: Config, run_path: Path):
        g = cfg.governance
        self.cfg, self.run_path = cfg, run_path
        self.policy: Policy | None = load_policy(g.policy) if g.policy else None
        self.hooks = resolve_hooks(g.hooks)
        self.audit = _audit_log(cfg, run_path) if g.lineage else None
        self.run_id = _previous_run_id(run_path) or uuid.uuid4().hex
        # What every checkpoint of the run carries in its metadata; known before the first save. The
        # log's head at the start is pinned in it: a log rewritten up to that record no longer matches.
        self.lineage: dict[str, Any] | None = None if self.audit is None else {
            "run_id": self.run_id, "audit_log": str(self.audit.path.resolve()),
            "outputs": self.policy.outputs() if self.policy else {}, "chain_head": self.audit.head(),
            **({"signer": self.audit.signer.keyid} if self.audit.signer else
               {"key_id": key_id(self.audit.key)} if self.audit.key else {}),
            **({"policy": {"name": self.policy.name, "file": str(Path(g.policy).resolve())}} if self.policy else {})}
        self.lineage_id: str | None = self.run_id if self.audit is not None else None
        self.hashes = HashCache(Path(cfg.run.out_dir) / STORE_DIR / CACHE_FILE)  # unchanged files are not re-read
        self.data_config: DataConfig = cfg.data
        self.manifest: dict[str, Any] | None = None
        self.val_manifest: dict[str, Any] | None = None  # --val-data's, when given
        self.isolation_bad: list[tuple[SampleInfo, str]] = []
        self.images = None

    # --- begin: everything here happens before any sample is decoded --------------------------

    def check(self) -> None:
        g, source = self.cfg.governance, self.cfg.data.source
        if self.audit is not None:
            self.audit.check_key()  # a signed log takes no unsigned record: say so before training
        if self.policy is not None:  # [provenance]: a run that must be signed does not start unsigned
            check_signing(self.policy, self.audit, g.policy)
        manifest = load_manifest(g.data_manifest) if g.data_manifest else None
        if manifest is not None and not describes(manifest, source):
            raise UserError(f"--data-manifest {g.data_manifest} describes {manifest['tc:source']}, "
                            f"not the training data {source}")
        if self.policy is not None:
            self._check_policy(manifest, source)
        if manifest is not None:
            problems = check_data(manifest, self._files_read(source), self.hashes)
            if problems:
                self._refuse(problems, f"the data no longer matches manifest {g.data_manifest}")
        if manifest is None and not (g.lineage or self.hooks or g.sample_grid):
            return  # governance off: nothing to hash, hook or record
        self.manifest = manifest or self._stored(build_manifest(source, self.cfg.data.root, cache=self.hashes))
        val = self.cfg.data.val_data  # read by the run too: hashed and recorded beside the training data
        self.val_manifest = self._stored(build_manifest(val, self.cfg.data.root, cache=self.hashes)) if val else None
        if self.audit is not None and manifest is not None:
            store_given(manifest, manifest_store(self.audit.path))
        self.record_infos = self._record_infos()
        self._file_hooks(source)

    def _stored(self, m: dict[str, Any]) -> dict[str, Any]:
        return m if self.audit is None else store_built(m, manifest_store(self.audit.path))

    def _check_policy(self, manifest: dict[str, Any] | None, source: str) -> None:
        g, val = self.cfg.governance, self.cfg.data.val_data
        if manifest is None and source not in BUILTIN_META:
            reasons = [f"{source}: no data manifest, so its license, jurisdiction and tags are unknown; "
                       f"create one with `torchcls data manifest {source} --license ... --jurisdiction ...` "
                       "and pass --data-manifest"]
        else:
            facts = facts_of(manifest) if manifest else facts_of(_builtin_stub(source))
            reasons = violations(self.policy, facts, g.region, {h.name for h in self.hooks})
        if val and val not in BUILTIN_META:
            reasons.append(f"--val-data {val}: a policy is checked against the manifest of --data only; make the "
                           "validation set the source's val split (a val/ folder, or a CSV split column) so that "
                           "its manifest covers it")
        elif val:
            reasons += violations(self.policy, facts_of(_builtin_stub(val)), g.region, {h.name for h in self.hooks})
        if reasons:
            self._refuse(reasons, "the policy forbids this run")

    def _file_hooks(self, source: str) -> None:
        """File-stage hooks: training reads hooked copies of the files, made in a private directory."""
        files = by_stage(self.hooks, "file")
        if not files or self.manifest["tc:source"] in BUILTIN_META:
            return
        names = ", ".join(h.name for h in files)
        if self.manifest.get("tc:packed"):
            raise UserError(f"--hooks {names}: file-stage hooks rewrite image files, but {source} packs its "
                            "samples into shards or tables; use a folder or CSV source")
        if self.cfg.data.val_data:
            raise UserError(f"--hooks {names}: --val-data {self.cfg.data.val_data} would be read without passing "
                            "the file-stage hooks; make it the source's val split (a val/ folder, or a CSV split "
                            "column)")
        self._isolate(files)

    def _files_read(self, source: str) -> list[Path] | None:
        """The files this run will read, listed as training lists them (its own --root)."""
        if source in BUILTIN_META:
            return None
        from torchcls.data.dataset_files import data_files

        return data_files(source, self.cfg.data.root)

    def checkpoint_metadata(self) -> dict[str, str]:
        """Entries for a checkpoint's safetensors metadata: the lineage (empty when lineage is off)."""
        return {LINEAGE_KEY: json.dumps(self.lineage, sort_keys=True)} if self.lineage else {}

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
        if images.paths is None and self.manifest.get("tc:packed"):  # no record per sample: the data set's facts
            m = self.manifest
            tags = frozenset(m.get("rai:personalSensitiveInformation") or [])
            restricted = set(self.policy.restricted_tags if self.policy else RESTRICTED_BY_DEFAULT)
            return SampleInfo(i, f"sample {i}", None, tags, m.get("dpv:hasJurisdiction"), bool(tags & restricted))
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

    def install_data(self, data) -> None:
        """The tensor hooks around the data set's images. Called before any feed is built: the in-memory
        cache decodes every image once, and it must decode them through the hooks too."""
        self.images = data.images
        tensor_hooks = by_stage(self.hooks, "tensor")
        if tensor_hooks:
            infos = [self.sample_info(data.images, i) for i in range(len(data.images))]
            hooked = HookedImages(data.images, tensor_hooks, infos)
            data.train.images = data.val.images = self.images = hooked

    def install_model(self, model):
        for h in by_stage(self.hooks, "model"):
            model = h.fn(model)
        return model

    # --- finish: outputs, the audit record ---------------------------------------------------------

    def finish(self, result) -> dict[str, Any]:
        """Outputs through the hooks, the run's artifacts hashed, the `run` record; rank 0 only."""
        if self.manifest is None:  # governance fully off for this run
            return {}
        if int(os.environ.get("RANK", "0")) != 0:  # torchrun: one record per run, from rank 0
            return {}
        run, g = self.run_path, self.cfg.governance
        summary: dict[str, Any] = {
            "lineage_id": self.run_id, "region": g.region, "hooks": [h.name for h in self.hooks],
            "policy": {"name": self.policy.name, "sha256": self.policy.digest, "file": g.policy} if self.policy
            else None, "manifest": _manifest_summary(self.manifest), "isolated_processing": hasattr(self, "workdir"),
            "hash_cache": self.hashes.stats(),
        }
        if self.val_manifest is not None:
            summary["val_manifest"] = _manifest_summary(self.val_manifest)
        summary["samples"] = self._samples()
        summary["redacted_file_names"] = redact_skipped(run / "skipped_files.json", self._lookup, self.hooks,
                                                        self.isolation_bad)
        if self.audit is not None:
            record = self._record_run(result, summary)
            summary["audit_record"] = {"seq": record["seq"], "hash": record["hash"], "log": self.lineage["audit_log"]}
        write_text_atomic(run / "governance.json", json.dumps(summary, indent=2))
        return summary  # the report's governance section reads governance.json (report/subscriber.py redraws it next)

    def _record_run(self, result, summary: dict[str, Any]) -> dict[str, Any]:
        run, cfg = self.run_path, self.cfg
        artifacts = []
        # Only the files this run's trainer wrote (result.written): a resumed run dir may hold others, which a
        # record of this run (and a signature over it) must not vouch for.
        for path in sorted(Path(p) for p in getattr(result, "written", ())):
            # Saved by a trainer that did not stamp it at save time. A stamp of this run from an earlier
            # attempt (another chain head) is kept: checkpoints are not rewritten after training.
            if path.suffix == ".safetensors" and (read_lineage(path) or {}).get("run_id") != self.run_id:
                stamp_checkpoint(path, self.lineage)
            if run_files.is_file(path) and not path.name.startswith("."):
                kind = "checkpoint" if path.suffix == ".safetensors" else "training-state"
                artifacts.append({"path": str(path.resolve()), "sha256": sha256_file(path),
                                  "artifact_kind": kind})
        manifests = [summary["manifest"], *([summary["val_manifest"]] if "val_manifest" in summary else [])]
        record = self.audit.append("run", {
            "run_id": self.run_id, "run_dir": str(run.resolve()), "resumed": cfg.run.resume,
            "manifests": manifests, "policy": self.policy.to_dict() if self.policy else None,
            "policy_sha256": self.policy.digest if self.policy else None, "region": cfg.governance.region,
            "hooks": summary["hooks"], "config": cfg.to_dict(), "code_version": code_version(),
            "environment": package_versions(), "metrics": _metrics(run, result), "artifacts": artifacts})
        # The run record's hash, pinned beside the run: `verify` compares it with the log.
        write_text_atomic(run / "lineage.json", json.dumps({**self.lineage, "record_hash": record["hash"],
                                                            "record_seq": record["seq"]}, indent=2))
        return record

    def _samples(self) -> dict[str, Any] | str:
        n, images = self.cfg.governance.sample_grid, self.images
        if n <= 0 or images is None:
            return "not requested"
        if self.policy is not None and not self.policy.sample_images:
            return "withheld: the policy forbids sample images leaving the run"
        from torchcls.tasks import label_names

        tb = self.run_path / "tensorboard" if self.cfg.train.tensorboard else None
        return sample_grid(images.load, lambda i: self.sample_info(images, i),
                           lambda i: label_names(images.targets[i], images.classes), len(images), self.hooks, n,
                           self.cfg.train.seed, self.run_path / "samples.png", tb)

    def _lookup(self, file: str) -> SampleInfo | None:
        images = self.images
        if images is None or images.paths is None:
            return None
        target = str(Path(file).resolve())
        for i, p in enumerate(images.paths):
            if str(Path(p).resolve()) == target:
                return self.sample_info(images, i)
        for k, r in enumerate(self.manifest["tc:records"]):  # skipped files are not in the ImageSet
            if str(record_path(self.manifest, r).resolve()) == target or Path(file).stem == r["sha256"]:
                return self.record_infos[k]
        return None


def on_run_started(event: RunStarted) -> None:
    """Every training run is governed (torchcls.consumers subscribes this): refused here, before any data is
    read, when its policy or data manifest says so; otherwise the run's guard."""
    event.guard = begin(event.cfg, event.run_path)


def on_run_finished(event: RunFinished) -> None:
    if isinstance(event.guard, Governance):
        event.guard.finish(event.result)


def begin(cfg: Config, run_path: Path) -> Governance:
    """Check the policy and the data's integrity; raises UserError (and logs a 'refused' record) on any
    violation, before the data set is opened."""
    # A refusal leaves no half-made run dir behind: train() removes the dir when this process created it
    # (training/rundir.py discard_failed_start); a path alone never says that, so nothing is removed here.
    gov = Governance(cfg, run_path)
    gov.check()
    return gov


def _audit_log(cfg: Config, run_path: Path) -> AuditLog:
    g = cfg.governance
    path = Path(g.audit_log or default_audit_log(cfg.run.out_dir))
    near = [run_path, path.parent]
    return AuditLog(path, load_key(g.audit_key_file, near=near), signer_from(g.signing_key_file, near=near))


def _previous_run_id(run_path: Path) -> str | None:
    """A resumed run keeps its lineage id: from lineage.json, or from its last checkpoint when the
    run stopped before finishing."""
    f = run_path / "lineage.json"
    if os.path.lexists(f):  # (a link is refused, not followed: a received run dir's)
        found = parse_lineage(run_files.read_bytes(f, max_bytes=SIDECAR_BYTES, what="lineage.json"), str(f))
        return found.get("run_id") if isinstance(found, dict) else None
    stamp = read_lineage(run_path / "checkpoints" / "last.safetensors")
    return stamp.get("run_id") if stamp else None


def _builtin_stub(source: str) -> dict[str, Any]:
    meta = BUILTIN_META[source]
    return {"name": meta.name, "license": meta.license, "dpv:hasJurisdiction": meta.jurisdiction,
            "rai:personalSensitiveInformation": meta.tags, "dpv:hasLegalBasis": meta.legal_basis,
            "expires": meta.expires, "tc:records": [], "tc:source": source}


def _manifest_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {"name": m.get("name"), "source": m["tc:source"], "merkle_root": m["tc:merkleRoot"],
            "manifest_sha256": manifest_hash(m), "manifest_hash_version": MANIFEST_HASH_VERSION,
            "records": m.get("tc:recordCount", len(m["tc:records"])), "license": m.get("license"),
            "jurisdiction": m.get("dpv:hasJurisdiction"), "tags": m.get("rai:personalSensitiveInformation")}


def _metrics(run: Path, result) -> dict[str, Any]:
    from torchcls.training.rundir import read_metrics

    epochs = [r for r in read_metrics(run) if r.get("kind") == "epoch"]
    last = epochs[-1] if epochs else {}
    return {"steps": result.steps, "best_val_top1": result.val_top1,
            **{k: v for k, v in last.items() if k in ("epoch", "train_loss", "train_top1", "val_loss", "val_top1",
                                                      "val_top5")}}
