"""--precision auto for a checkpoint (predict, serve) checks bf16 against fp32 on held-out images once per
checkpoint content and machine, and remembers the measurement in the user's own cache folder
(artifacts/eager_auto.py, artifacts/auto_check_store.py). A record that is damaged, forged, linked, for
other weights or in a folder others may write is not used: the check runs again and replaces it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_image_folder, tiny_config
from torchcls.artifacts import auto_check_store as store
from torchcls.artifacts import load_artifact
from torchcls.checkpoint.files import read_meta, resolve_checkpoint, write_weights
from torchcls.prediction import predict

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny trained run whose data folder a test may move away (the held-out images gone)."""
    from torchcls.training import train

    base = tmp_path_factory.mktemp("auto-cache")
    data = make_image_folder(base / "shapes", per_class=16)
    return train(tiny_config(data, base / "runs", epochs=1)).run_dir


@pytest.fixture(autouse=True)
def bf16_here_and_own_cache(monkeypatch, tmp_path) -> Path:
    """bf16 counts as native on any CPU (so auto has a reduced precision to check), and a fresh cache folder."""
    from torchcls.precision import hardware

    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: (True, "this CPU computes bf16 natively (test)"))
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / store.FOLDER


def _records(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def test_a_second_predict_reuses_the_check_without_the_held_out_images(run, tmp_path, capsys,
                                                                       bf16_here_and_own_cache):
    folder = bf16_here_and_own_cache
    image = next((Path(read_meta(resolve_checkpoint(run)).config["data"]["source"]) / "circle").iterdir())
    first = predict(run, [image])
    err = capsys.readouterr().err
    assert "precision auto -> bf16" in err and "checked now" in err and "remembered in" in err
    [record] = _records(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(record.stat().st_mode) == 0o600
    # The held-out images are gone: a second start that built the held-out split would fall back to fp32.
    data = Path(read_meta(resolve_checkpoint(run)).config["data"]["source"])
    moved = data.with_name("moved-away")
    image = Path(str(image).replace(str(data), str(moved)))
    data.rename(moved)
    try:
        second = predict(run, [image])
        err = capsys.readouterr().err
        assert "precision auto -> bf16" in err and "(cached check" in err and "checked now" not in err
        assert err.count("\n") == 1  # one line says what runs and where the decision came from
        assert second.items[0]["top"] == first.items[0]["top"] and second.precision in err
        assert "cached check" in load_artifact(run).choice.reason  # serve's path shares the record
    finally:
        moved.rename(data)
    assert _records(folder) == [record]


def _tamper_cases(original: dict) -> dict:
    other_key = dict(original, key=dict(original["key"], weights_sha256="0" * 64))
    return {
        "not JSON": b"{not json",
        "agreement out of range": json.dumps(dict(original, top1_agreement=1.5)).encode(),
        "a boolean for n": json.dumps(dict(original, n=True)).encode(),
        "another checkpoint's key": json.dumps(other_key).encode(),
        "an extra field": json.dumps(dict(original, code="import os")).encode(),
        "over the size bound": json.dumps(dict(original, pad="x" * store.RECORD_BOUNDS.max_bytes)).encode(),
    }


@pytest.mark.parametrize("case", ["not JSON", "agreement out of range", "a boolean for n", "another checkpoint's key",
                                  "an extra field", "over the size bound", "a link to a forged record"])
def test_a_tampered_record_is_ignored_and_rewritten(run, tmp_path, case, bf16_here_and_own_cache):
    folder = bf16_here_and_own_cache
    assert "checked now" in load_artifact(run).choice.reason
    [record] = _records(folder)
    original = json.loads(record.read_text())
    if case == "a link to a forged record":  # forged elsewhere (a run dir the user was sent), linked in
        forged = tmp_path / "forged.json"
        forged.write_text(json.dumps(dict(original, top1_agreement=0.0)))
        record.unlink()
        record.symlink_to(forged)
    else:
        record.write_bytes(_tamper_cases(original)[case])
    artifact = load_artifact(run)
    assert "cached record not used" in artifact.choice.reason and "checked now" in artifact.choice.reason
    assert artifact.info.precision == "bf16"  # measured again, not taken from the tampered record
    assert not record.is_symlink() and json.loads(record.read_text()) == original  # replaced, not written through
    if case == "a link to a forged record":
        assert json.loads(forged.read_text())["top1_agreement"] == 0.0
    assert "cached check" in load_artifact(run).choice.reason


def test_changed_weights_are_checked_again_and_a_copy_is_not(run, tmp_path, bf16_here_and_own_cache):
    folder = bf16_here_and_own_cache
    assert "checked now" in load_artifact(run).choice.reason
    ckpt = resolve_checkpoint(run)
    copy = tmp_path / "copy.safetensors"  # the same content outside its run dir: the same decision
    copy.write_bytes(ckpt.read_bytes())
    assert "cached check" in load_artifact(copy).choice.reason
    state = load_file(ckpt)
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name] + 1e-3  # other weights: a new digest
    changed = tmp_path / "changed.safetensors"
    write_weights(changed, state, read_meta(ckpt))
    assert "checked now" in load_artifact(changed).choice.reason
    assert len(_records(folder)) == 2


def test_another_thread_count_is_checked_again(run, bf16_here_and_own_cache):
    assert "checked now" in load_artifact(run).choice.reason
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads != 1 else 2)  # bf16 reductions split by thread: another measurement
    try:
        assert "checked now" in load_artifact(run).choice.reason
    finally:
        torch.set_num_threads(threads)
    assert len(_records(bf16_here_and_own_cache)) == 2


def test_a_cache_folder_others_can_write_is_not_used(run, bf16_here_and_own_cache):
    folder = bf16_here_and_own_cache
    assert "checked now" in load_artifact(run).choice.reason
    os.chmod(folder, 0o777)  # anyone could have put a record here
    try:
        reason = load_artifact(run).choice.reason
        assert "checked now" in reason and "chmod 700" in reason and "not remembered" in reason
    finally:
        os.chmod(folder, 0o700)
    assert "cached check" in load_artifact(run).choice.reason


def test_the_cache_keeps_at_most_max_records(monkeypatch, bf16_here_and_own_cache):
    monkeypatch.setattr(store, "MAX_RECORDS", 3)
    folder, keys = bf16_here_and_own_cache, [{"weights_sha256": f"{i:064x}"} for i in range(5)]
    for i, key in enumerate(keys):
        assert store.remember(key, store.Measured(1.0, 10)).startswith("remembered")
        os.utime(folder / store.record_name(key), (1e9 + i, 1e9 + i))  # distinct ages (mtime ticks are coarse)
    assert {p.name for p in _records(folder)} == {store.record_name(k) for k in keys[2:]}
