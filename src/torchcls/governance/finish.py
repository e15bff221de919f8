"""The end of a governed run: sample outputs through the hooks, checkpoints stamped with the
lineage id and hashed, and one `run` record appended to the audit log."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchcls.governance.artifacts import stamp_checkpoint
from torchcls.governance.digest import sha256_file
from torchcls.governance.environment import code_version, package_versions
from torchcls.governance.manifest import manifest_hash
from torchcls.governance.outputs import redact_skipped, sample_grid


def finish_run(gov, result) -> dict[str, Any]:
    if gov.manifest is None:  # governance fully off for this run
        return {}
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: one record and one stamp per run, from rank 0
        return {}
    run, cfg, g = gov.run_path, gov.cfg, gov.cfg.governance
    summary: dict[str, Any] = {
        "lineage_id": gov.run_id, "region": g.region, "hooks": [h.name for h in gov.hooks],
        "policy": {"name": gov.policy.name, "sha256": gov.policy.digest, "file": g.policy} if gov.policy else None,
        "manifest": _manifest_summary(gov.manifest), "isolated_processing": hasattr(gov, "workdir"),
    }
    summary["samples"] = _samples(gov, run)
    summary["redacted_file_names"] = redact_skipped(run / "skipped_files.json", lambda f: _lookup(gov, f),
                                                    gov.hooks, gov.isolation_bad)
    if gov.audit is not None:
        lineage = {"run_id": gov.run_id, "audit_log": str(gov.audit.path.resolve()),
                   "outputs": gov.policy.outputs() if gov.policy else {}}
        artifacts = []
        for path in sorted(run.joinpath("checkpoints").glob("*")):
            if path.suffix == ".safetensors":
                stamp_checkpoint(path, lineage)
            if path.is_file() and not path.name.startswith("."):
                kind = "checkpoint" if path.suffix == ".safetensors" else "training-state"
                artifacts.append({"path": str(path.resolve()), "sha256": sha256_file(path), "artifact_kind": kind})
        record = gov.audit.append("run", {
            "run_id": gov.run_id, "run_dir": str(run.resolve()), "resumed": cfg.run.resume,
            "manifests": [summary["manifest"]], "policy": gov.policy.to_dict() if gov.policy else None,
            "policy_sha256": gov.policy.digest if gov.policy else None, "region": g.region,
            "hooks": summary["hooks"], "config": cfg.to_dict(), "code_version": code_version(),
            "environment": package_versions(), "metrics": _metrics(run, result), "artifacts": artifacts})
        (run / "lineage.json").write_text(json.dumps({**lineage, "record_hash": record["hash"],
                                                      "record_seq": record["seq"]}, indent=2))
        summary["audit_record"] = {"seq": record["seq"], "hash": record["hash"], "log": lineage["audit_log"]}
    (run / "governance.json").write_text(json.dumps(summary, indent=2))
    from torchcls.report import write_report

    write_report(run)
    return summary


def _manifest_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {"name": m.get("name"), "source": m["tc:source"], "merkle_root": m["tc:merkleRoot"],
            "manifest_sha256": manifest_hash(m), "records": m["tc:recordCount"], "license": m.get("license"),
            "jurisdiction": m.get("dpv:hasJurisdiction"), "tags": m.get("rai:personalSensitiveInformation")}


def _samples(gov, run: Path) -> dict[str, Any] | str:
    n = gov.cfg.governance.sample_grid
    if n <= 0 or gov.images is None:
        return "not requested"
    if gov.policy is not None and not gov.policy.sample_images:
        return "withheld: the policy forbids sample images leaving the run"
    images = gov.images
    tb = run / "tensorboard" if gov.cfg.train.tensorboard else None
    return sample_grid(images.load, lambda i: gov.sample_info(images, i),
                       lambda i: images.classes[int(images.targets[i])], len(images), gov.hooks, n,
                       gov.cfg.train.seed, run / "samples.png", tb)


def _lookup(gov, file: str):
    images = gov.images
    if images is None or images.paths is None:
        return None
    target = str(Path(file).resolve())
    for i, p in enumerate(images.paths):
        if str(Path(p).resolve()) == target:
            return gov.sample_info(images, i)
    recs = gov.manifest["tc:records"]
    from torchcls.governance.integrity import record_path

    for k, r in enumerate(recs):  # skipped files are not in the ImageSet: find them in the manifest
        if str(record_path(gov.manifest, r).resolve()) == target or Path(file).stem == r["sha256"]:
            return gov.record_infos[k]
    return None


def _metrics(run: Path, result) -> dict[str, Any]:
    from torchcls.training.rundir import read_metrics

    epochs = [r for r in read_metrics(run) if r.get("kind") == "epoch"]
    last = epochs[-1] if epochs else {}
    return {"steps": result.steps, "best_val_top1": result.val_top1,
            **{k: v for k, v in last.items() if k in ("epoch", "train_loss", "train_top1", "val_loss", "val_top1",
                                                      "val_top5")}}
