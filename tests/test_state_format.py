"""The single-process training state without pickle: last.state.safetensors holds the tensors, and the tree
around them as JSON in its metadata (checkpoint/state_tree.py, checkpoint/state_file.py). An older run's
last.state.pt (torch.save) is read only with --unsafe-unpickle; so are --pretrained .pth files."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from conftest import tiny_config
from torchcls.bounded_json import load_bounded
from torchcls.checkpoint.files import LAST_STATE, LEGACY_STATE, load_training_state, save_training_state
from torchcls.checkpoint.state_file import FORMAT, FORMAT_KEY, STATE_KEY, STEP_KEY, read_step
from torchcls.checkpoint.state_tree import STATE_BOUNDS, flatten, unflatten
from torchcls.config import Config, load_toml
from torchcls.errors import UserError


def _same(a, b) -> bool:
    """Equal trees: same types all the way down (int keys stay ints, tuples stay tuples), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _round_trip(tree, tmp_path: Path):
    path = tmp_path / "s.safetensors"
    save_training_state(path, tree)
    return load_training_state(path)


# -- round trips ------------------------------------------------------------------------------------------
def test_optimizer_scheduler_and_scaler_state_come_back_exactly(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)  # its best starts at inf
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
    state = {"step": 2, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "precision": torch.amp.GradScaler("cpu", enabled=False).state_dict(), "rng": torch.get_rng_state(),
             "model": {k: v.clone() for k, v in model.state_dict().items()}, "best_top1": -1.0}
    back = _round_trip(state, tmp_path)
    assert _same(back, state)
    assert set(back["optimizer"]["state"]) == {0, 1, 2, 3}  # int keys, as load_state_dict needs them
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    fresh.load_state_dict(back["optimizer"])
    assert _same(fresh.state_dict(), optimizer.state_dict())


def test_dtypes_views_and_odd_values(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32)
    tree = {"step": 7, "bf16": torch.randn(3, 2).to(torch.bfloat16), "half": torch.ones(2, dtype=torch.float16),
            "ints": torch.arange(5), "mask": torch.tensor([True, False]), "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4), "view_a": base[:6], "view_b": base[6:], "again": base,  # one storage
            "strided": base.view(3, 4).t(), (1, "k"): None, 3: [1, (2, 3.5), {"tensor": "not a tag"}],
            "floats": [math.inf, -math.inf, math.nan, -0.0], "big": 2**80, "neg": -(2**70), "s": "é\u2603"}
    assert _same(_round_trip(tree, tmp_path), tree)


_keys = st.one_of(st.integers(-5, 10**20), st.text(max_size=6), st.none(), st.booleans(),
                  st.tuples(st.integers(0, 3), st.text(max_size=3)))
_tensors = st.builds(lambda shape, dtype: (torch.rand(shape) * 100).to(dtype),
                     st.lists(st.integers(0, 3), max_size=3), st.sampled_from(
                         [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]))
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**100), 2**100), st.floats(), st.text(max_size=10),
                    _tensors)
_trees = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
    st.dictionaries(_keys, inner, max_size=4)), max_leaves=25)


@settings(max_examples=100, deadline=None)
@given(tree=_trees)
def test_flatten_then_unflatten_is_the_identity(tree) -> None:
    encoded, tensors = flatten(tree)
    text = json.dumps(encoded, allow_nan=False)  # strict JSON: non-finite floats are tagged
    assert _same(unflatten(load_bounded(text, STATE_BOUNDS, "t"), tensors, "t"), tree)


# -- hostile files ----------------------------------------------------------------------------------------
_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                                                                                   allow_infinity=False),
                               st.text(max_size=8), st.sampled_from(["dict", "tuple", "tensor", "int", "float", "t0"])),
                     lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(
                         st.sampled_from(["dict", "tuple", "tensor", "int", "float", "x"]), inner, max_size=2)),
                     max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(value=_json)
def test_any_json_state_gives_values_or_a_user_error(value) -> None:
    try:
        tree = unflatten(value, {"t0": torch.zeros(2)}, "state")
    except UserError as e:
        assert "state" in str(e)
    else:  # only values of the allowed kinds come back
        stack = [tree]
        while stack:
            v = stack.pop()
            assert v is None or isinstance(v, (bool, int, float, str, list, tuple, dict, torch.Tensor))
            stack.extend(v if isinstance(v, (list, tuple)) else [*v.keys(), *v.values()] if isinstance(v, dict) else [])


@pytest.mark.parametrize("text, message", [
    ('{"dict": [[{"dict": []}, 1]]}', "dict key"),
    ('{"tensor": "t9"}', "does not hold"),
    ('{"int": "1' + "0" * 100 + '"}', "tagged int"),
    ('{"float": "1e999"}', "tagged float"),
    ('{"object": 1}', "none of"),
    ('{"dict": [[1, 2, 3]]}', "pairs"),
    ("[" * 100 + "]" * 100, "deeper"),
    ('{"dict": []}', "holds no step"),
])
def test_a_crafted_state_file_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / LAST_STATE
    save_file({"t0": torch.zeros(2)}, str(path), metadata={STATE_KEY: text, STEP_KEY: "1", FORMAT_KEY: FORMAT})
    with pytest.raises(UserError, match=message):
        load_training_state(path)


def test_the_step_is_read_from_the_header_alone(tmp_path: Path) -> None:
    path = tmp_path / LAST_STATE
    save_training_state(path, {"step": 41, "w": torch.zeros(3)})
    assert read_step(path) == 41
    save_file({"w": torch.zeros(1)}, str(path), metadata={STEP_KEY: "9" * 40, FORMAT_KEY: FORMAT, STATE_KEY: "{}"})
    assert read_step(path) is None  # no number of 40 digits is taken for a step
    path.write_bytes(b"\x80\x04junk")
    assert read_step(path) is None


# -- no pickle in a run dir; an older one resumes only when asked -------------------------------------------
def _pickles(root: Path) -> list[str]:
    """Files that are pickles: protocol 2-5 at offset 0, or a torch.save zip (a data.pkl inside)."""
    found = []
    for path in (p for p in root.rglob("*") if p.is_file()):
        head = path.read_bytes()[:4]
        if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
            found.append(str(path))
        elif head == b"PK\x03\x04" and any(n.endswith("data.pkl") for n in zipfile.ZipFile(path).namelist()):
            found.append(str(path))
    return found


def test_a_single_process_run_dir_holds_no_pickle_and_an_older_one_resumes_only_when_asked(
        tmp_path: Path, shapes_dir: Path) -> None:
    from torchcls.training import train

    full = train(tiny_config(shapes_dir, tmp_path, "full", epochs=3))
    assert _pickles(full.run_dir) == [] and (full.run_dir / "checkpoints" / LAST_STATE).is_file()

    cfg = tiny_config(shapes_dir, tmp_path, "old", epochs=3)
    train(cfg, callbacks=[lambda step: (_ for _ in ()).throw(KeyboardInterrupt) if step == 6 else None])
    ckpt = full.run_dir.parent / "old" / "checkpoints"
    # what an older torchcls left: the same state, pickled by torch.save as last.state.pt
    torch.save(load_training_state(ckpt / LAST_STATE), ckpt / LEGACY_STATE)
    (ckpt / LAST_STATE).unlink()
    cfg.run.resume = True
    with pytest.raises(UserError, match=f"{LEGACY_STATE} is a pickle .* --unsafe-unpickle"):
        train(cfg)
    cfg.checkpoint.unsafe_unpickle = True
    resumed = train(cfg)
    assert resumed.steps == full.steps == 12
    a, b = load_file(full.last_checkpoint), load_file(resumed.last_checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)  # exact resume from the older format
    assert load_training_state(ckpt / LAST_STATE)["step"] == 12  # and its next checkpoint is pickle-free


def test_no_file_can_grant_the_unpickling_opt_in(tmp_path: Path) -> None:
    toml = tmp_path / "config.toml"
    toml.write_text("[checkpoint]\nunsafe_unpickle = true\n")
    with pytest.raises(UserError, match="cannot be set by a file.*--unsafe-unpickle"):
        load_toml(toml)
    toml.write_text("[train]\nunsafe_unpickle = true\n")  # nor through the section it would have moved from
    with pytest.raises(UserError, match="cannot be set by a file"):
        load_toml(toml)
    cfg = Config()
    cfg.checkpoint.unsafe_unpickle = True
    assert "unsafe_unpickle" not in cfg.to_dict()["checkpoint"]  # never written to config.toml or a checkpoint
    from torchcls.cli import build_parser
    from torchcls.options import config_from_args

    args = build_parser().parse_args(["train", "--unsafe-unpickle"])
    assert config_from_args(args).checkpoint.unsafe_unpickle is True
