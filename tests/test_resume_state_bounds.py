"""`torchcls train --resume` of a (possibly received) run dir: the state it reads is typed and ranged before use.

- checkpoints/loader.rank{N}.json (streamed shards): torchdata's StatefulDataLoader loops over counts in the state it
  is given when a resume starts; a count of 10**12 hung `iter()`. Every field is now checked against what this loader
  can have produced in one epoch (streaming.check_saved_state), so a resume does at most an epoch's work.
- checkpoints/last.state.safetensors (one process): only `step` was checked; the other fields reached torch as they
  were (a float RNG state, a string epoch, a step past the epoch: tracebacks). They now go through the checks of the
  sharded format's state.json (sharded_state), and each part is held to the shape of this run's own.
Each field of a real saved state is replaced in turn by a value of another type or out of range: a UserError (exit 2
from the command line), never another exception, never a hang.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import make_image_folder, tiny_config
from torchcls.errors import UserError

WRONG = ["x", [], {}, 1.5, True, None, -1, 10**12]  # of another type, or out of any range a loader reaches


def _stop_at(step: int):
    def stop(s: int) -> None:
        if s == step:
            raise RuntimeError("stopped by the test")
    return stop


def _resume(cfg) -> None:
    from torchcls.training import train

    cfg.run.resume = True
    train(cfg)


# -- the streamed loader's state ------------------------------------------------------------------------------------

def _shard_config(shards: Path, out: Path, name: str):
    cfg = tiny_config(shards, out, name, epochs=1)
    cfg.data.workers, cfg.data.augment, cfg.checkpoint.save_every = 1, "flip", 3
    cfg.governance.lineage = False
    return cfg


@pytest.fixture(scope="module")
def shard_run(tmp_path_factory) -> tuple[Path, Path]:
    """(shards, a run dir stopped at step 4 of 6, after its step-3 checkpoint wrote loader.rank0.json)."""
    from torchcls.data.shards import write_shards
    from torchcls.training import train

    base = tmp_path_factory.mktemp("shard-resume")
    shards = base / "shards"
    write_shards(str(make_image_folder(base / "shapes", per_class=28)), shards, 40_000)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(_shard_config(shards, base / "runs", "cut"), callbacks=[_stop_at(4)])
    assert (base / "runs" / "cut" / "checkpoints" / "loader.rank0.json").is_file()
    return shards, base / "runs" / "cut"


def _with_loader_file(shard_run, tmp_path: Path, edit) -> Any:
    """A copy of the stopped run whose loader.rank0.json `edit` (a function of the parsed JSON) rewrote."""
    shards, run = shard_run
    shutil.copytree(run, tmp_path / "cut")
    path = tmp_path / "cut" / "checkpoints" / "loader.rank0.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps(edit(saved)))
    return _shard_config(shards, tmp_path, "cut")


def _set(saved: dict, keys: tuple, value: Any) -> dict:
    node = saved
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return saved


@pytest.mark.timeout(300)
def test_an_untouched_loader_state_still_resumes(shard_run, tmp_path: Path):
    cfg = _with_loader_file(shard_run, tmp_path, lambda s: s)
    _resume(cfg)
    assert not (tmp_path / "cut" / "checkpoints" / "loader.rank0.json").exists()  # the epoch ended


@pytest.mark.timeout(300)
@pytest.mark.parametrize("keys", [
    ("loader", "_snapshot", "_last_yielded_worker_id"),  # the review's payload: range(10**12 + 1) in iter()
    ("loader", "_steps_since_snapshot"),  # a batch fetched per count
    ("loader", "_snapshot", "_snapshot_step"),
    ("loader", "_snapshot", "_worker_snapshots", "worker_0", "dataset_state", "pos"),
])
def test_a_count_past_the_epoch_is_refused_before_torchdata_loops_over_it(shard_run, tmp_path: Path, keys):
    cfg = _with_loader_file(shard_run, tmp_path, lambda s: _set(s, keys, 10**12))
    with pytest.raises(UserError, match=rf"loader\.rank0\.json: .*{keys[-1]}.*delete .*loader\.rank0\.json"):
        _resume(cfg)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("edit", [lambda s: _set(s, ("step",), [3]), lambda s: {"loader": s["loader"]},
                                  lambda s: _set(s, ("step",), "3"), lambda s: [s]])
def test_a_loader_file_of_another_shape_is_refused(shard_run, tmp_path: Path, edit):
    with pytest.raises(UserError, match=r"loader\.rank0\.json"):
        _resume(_with_loader_file(shard_run, tmp_path, edit))


def test_the_command_line_says_what_to_do_with_exit_2(shard_run, tmp_path: Path, capsys):
    from torchcls.cli import main

    cfg = _with_loader_file(shard_run, tmp_path, lambda s: _set(s, ("loader", "_steps_since_snapshot"), 10**12))
    cfg.run.resume = True
    cfg.save_toml(tmp_path / "cut.toml")
    assert main(["train", "--config", str(tmp_path / "cut.toml"), "--resume"]) == 2
    assert "delete" in capsys.readouterr().err


def _leaves(tree: Any, keys: tuple = ()) -> list[tuple]:
    """The key path of every value in `tree` (containers included: each may be replaced whole)."""
    out = [keys] if keys else []
    if isinstance(tree, dict):
        return out + [p for k, v in tree.items() for p in _leaves(v, keys + (k,))]
    if isinstance(tree, list):
        return out + [p for i, v in enumerate(tree) for p in _leaves(v, keys + (i,))]
    return out


def _saved_loader_state(shards, workers: int) -> tuple[Any, dict]:
    from torchcls.data.shards import open_shards
    from torchcls.data.streaming import shard_loader

    shardset = open_shards(str(shards))
    make = lambda: shard_loader(shardset, 8, workers, seed=1, block=16)  # noqa: E731
    loader = make()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return make, state


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [0, 1])
def test_every_field_of_a_loader_state_replaced_is_refused_or_stays_within_the_epoch(shard_run, workers: int):
    """Each field in turn, with each wrong value: a UserError when loaded, or (a value of the right type and range,
    e.g. a bool for a bool) a resume that reads at most the epoch; never another exception, never a hang."""
    make, good = _saved_loader_state(shard_run[0], workers)
    accepted = []
    for keys in _leaves(good):
        for value in WRONG:
            state = _set(json.loads(json.dumps(good)), keys, value)
            loader = make()
            try:
                loader.load_state_dict(state, "loader.rank0.json")
            except UserError as e:
                assert str(e).startswith("loader.rank0.json"), e  # the file, named first
                continue
            accepted.append((keys, value))
            try:
                assert sum(1 for _ in loader) <= len(loader)
            except UserError:
                pass
    # What passes is of the right type and inside the epoch: nullable fields, flags, a seed
    assert all(v in (True, None, -1, 10**12) or k[-1] in ("skipped",) for k, v in accepted), accepted


# -- the single-process training state ------------------------------------------------------------------------------

def _single_config(images: Path, out: Path, name: str):
    cfg = tiny_config(images, out, name, epochs=1)
    cfg.data.in_memory, cfg.checkpoint.save_every, cfg.optim.ema = "on", 2, 0.9
    cfg.governance.lineage = False
    return cfg


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> tuple[Path, Path]:
    """(images, a run dir stopped at step 3 of 4, after its step-2 checkpoint wrote last.state.safetensors)."""
    from torchcls.training import train

    base = tmp_path_factory.mktemp("single-resume")
    images = make_image_folder(base / "shapes", per_class=16)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(_single_config(images, base / "runs", "cut"), callbacks=[_stop_at(3)])
    return images, base / "runs" / "cut"


def _with_state(single_run, tmp_path: Path, edit):
    """A copy of the stopped run whose training state `edit` (a function of the loaded state) rewrote."""
    from torchcls.checkpoint.files import load_training_state, save_training_state

    images, run = single_run
    shutil.copytree(run, tmp_path / "cut")
    path = tmp_path / "cut" / "checkpoints" / "last.state.safetensors"
    save_training_state(path, edit(load_training_state(path)))
    return _single_config(images, tmp_path, "cut")


def test_an_untouched_training_state_still_resumes(single_run, tmp_path: Path):
    _resume(_with_state(single_run, tmp_path, lambda s: s))


def test_the_reviews_state_is_refused(single_run, tmp_path: Path):
    payload = {"epoch": "x", "step_in_epoch": 10**60, "rng": torch.zeros(3)}
    with pytest.raises(UserError, match=r"training state .*last\.state\.safetensors: epoch must be an integer"):
        _resume(_with_state(single_run, tmp_path, lambda s: s | payload))


def test_a_param_group_key_only_one_torch_version_has_still_resumes(single_run, tmp_path: Path):
    """A key one torch version adds to an optimizer's groups (and fills in when it loads an older state) is not
    compared: a run saved under the other version must still resume."""
    def older(state: dict) -> dict:
        for group in state["optimizer"]["param_groups"]:
            group.pop("differentiable")
            group["a_later_option"] = False
        return state

    _resume(_with_state(single_run, tmp_path, older))


def _replace(state: dict, keys: tuple, value: Any) -> dict:
    node = state
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return state


SINGLE_FIELDS = [("epoch",), ("step",), ("step_in_epoch",), ("best_top1",), ("rng",), ("epoch_sums",), ("model",),
                 ("optimizer",), ("optimizer", "state"), ("optimizer", "state", 0, "exp_avg"),
                 ("optimizer", "state", 0, "step"), ("optimizer", "param_groups"),
                 ("optimizer", "param_groups", 0, "lr"), ("optimizer", "param_groups", 0, "params"),
                 ("scheduler",), ("scheduler", "last_epoch"), ("scheduler", "_last_lr"), ("scheduler", "base_lrs"),
                 ("extras",), ("extras", "ema")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("keys", SINGLE_FIELDS, ids=lambda k: ".".join(map(str, k)))
def test_every_field_of_a_training_state_replaced_is_refused_or_resumes(single_run, tmp_path: Path, keys):
    """A field of another type, out of range, or a tensor of another kind: a UserError naming the file. What is
    not refused is a value of the field's own type and range (a number for a counter or a rate, no epoch sums,
    no optimizer moments yet), and the run resumes with it: never another exception."""
    accepted = []
    for i, value in enumerate(WRONG + [torch.zeros(3), torch.zeros(5056, dtype=torch.int64)]):
        cfg = _with_state(single_run, tmp_path / str(i), lambda s, v=value: _replace(s, keys, v))
        try:
            _resume(cfg)
        except UserError as e:
            assert re.search(r"last\.state\.safetensors|this run's epochs", str(e)), e
            continue
        accepted.append(value)
    number = [v for v in WRONG if type(v) in (int, float) and v >= 0]  # (a negative one is refused: a counter's)
    allowed = {("epoch_sums",): [None], ("optimizer", "state"): [{}], ("optimizer", "state", 0, "exp_avg"): [],
               ("best_top1",): [-1] + number,
               ("optimizer", "param_groups", 0, "lr"): [-1] + number}.get(keys, number)
    assert all(any(v is a or (type(v) is type(a) and v == a) for a in allowed) for v in accepted), accepted


def test_a_step_past_the_epoch_is_refused_not_a_value_error(single_run, tmp_path: Path):
    cfg = _with_state(single_run, tmp_path, lambda s: s | {"step_in_epoch": 1000})
    with pytest.raises(UserError, match="at step 1000 of an epoch, but this run's epochs have 4 steps"):
        _resume(cfg)
