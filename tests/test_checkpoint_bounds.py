"""Issue 30, finding 4: a number in a checkpoint's metadata sized an allocation before anything checked it.
`spec.num_classes = 8000000` in a .safetensors file made `load_model` (predict, serve, evaluate, export)
build a 2.7 GB model before comparing it with the weights; the same in a DCP dir's meta.json made
`consolidate` do so. Now every field is bounded first (checkpoint/meta_check.py) and the file's shapes
are compared with the model built on the meta device before it is built on the CPU (checkpoint/fit.py).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.torch import load_file, save_file

from bounds_check import Stopwatch
from torchcls.checkpoint.files import META_KEY, CheckpointMeta, load_model, model_state, read_meta, write_weights
from torchcls.checkpoint.fit import MAX_PARAMETERS, check_sizes, fitted_model, meta_shapes
from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError
from torchcls.models.registry import MAX_CLASSES, ModelSpec, create_model

SPEC = ModelSpec("smallnet", 2, 3, 32)
RSS_BOUND_MB = 200


def _deep(n: int) -> object:
    value: object = 0
    for _ in range(n):
        value = [value]
    return value


def _meta(spec: ModelSpec = SPEC) -> CheckpointMeta:
    classes = [f"c{i}" for i in range(spec.num_classes)]
    return CheckpointMeta(spec, classes, Preprocess(spec.img_size, spec.in_chans, (0.5,) * spec.in_chans,
                                                    (0.25,) * spec.in_chans), {"data": {"task": "multiclass"}}, 1, 4)


def _checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    write_weights(path, model_state(create_model(SPEC)), _meta())
    return path


def _tampered(src: Path, dst: Path, edit) -> Path:
    """`src` with its metadata JSON changed by `edit(raw)`; the tensors as they were."""
    raw = json.loads(json.dumps(_meta_dict(src)))
    edit(raw)
    save_file(load_file(src), str(dst), metadata={META_KEY: json.dumps(raw)})
    return dst


def _meta_dict(path: Path) -> dict:
    from dataclasses import asdict

    return asdict(read_meta(path))


def _isolated(code: str, timeout: float = 120) -> dict:
    """Run `code` in a fresh interpreter after torch and timm are imported; it sets `result`. Returns
    result plus the peak RSS growth (MB) and seconds of the code alone: a fresh process, so a peak of
    an earlier test cannot hide this one's."""
    script = textwrap.dedent("""
        import json, resource, sys, time
        import timm, torch, torchcls.checkpoint.files, torchcls.cli
        from torchcls.errors import UserError
        before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
        result = {}
    """) + textwrap.dedent(code) + textwrap.dedent("""
        result["grew_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        result["seconds"] = time.monotonic() - t0
        print("RESULT " + json.dumps(result))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(line[len("RESULT "):]) | {"stderr": r.stderr}


# -- finding 4, reproduced --------------------------------------------------------------------------------
def test_predict_refuses_8_million_classes_before_building_anything(tmp_path: Path) -> None:
    """Was: 2.74 GB peak, then a shape-mismatch error (60M classes: ~15 GB)."""
    bomb = _tampered(_checkpoint(tmp_path / "ok.safetensors"), tmp_path / "bomb.safetensors",
                     lambda raw: raw["spec"].update(num_classes=8_000_000))
    image = tmp_path / "x.png"
    Image.new("RGB", (32, 32)).save(image)
    out = _isolated(f"""
        result["rc"] = torchcls.cli.main(["predict", {str(bomb)!r}, {str(image)!r}])
    """)
    assert out["rc"] == 2 and "num_classes must be an integer in [1, 100,000]" in out["stderr"], out
    assert str(bomb) in out["stderr"] and "Traceback" not in out["stderr"]
    assert out["grew_mb"] < RSS_BOUND_MB and out["seconds"] < 30, out


def test_a_bounded_spec_whose_head_the_file_lacks_is_refused_on_the_meta_device(tmp_path: Path) -> None:
    """The next attack: a spec within every bound (resnet50, 100,000 classes: an 820 MB head) over the
    weights of a 2-class SmallNet. The shapes disagree on the meta device: nothing is built on the CPU."""
    def edit(raw: dict) -> None:
        raw["spec"].update(name="resnet50", num_classes=MAX_CLASSES)
        raw["classes"] = [f"c{i}" for i in range(MAX_CLASSES)]

    bomb = _tampered(_checkpoint(tmp_path / "ok.safetensors"), tmp_path / "big.safetensors", edit)
    out = _isolated(f"""
        try:
            torchcls.checkpoint.files.load_model({str(bomb)!r})
        except UserError as e:
            result["error"] = str(e)
    """)
    assert "does not fit the model" in out.get("error", ""), out
    assert out["grew_mb"] < RSS_BOUND_MB and out["seconds"] < 60, out


def test_consolidate_refuses_8_million_classes_in_meta_json(tmp_path: Path) -> None:
    """The same number in a DCP dir's meta.json: refused when meta.json is read, before the model exists."""
    from torchcls.checkpoint import dcp
    from torchcls.checkpoint.checkpointer import SingleProcess
    from torchcls.checkpoint.consolidate import consolidate

    path = tmp_path / "run" / "checkpoints" / "last.dcp"
    path.parent.mkdir(parents=True)
    model = create_model(SPEC)
    dcp.start_save(path, {"model": model.state_dict()}, SingleProcess())
    dcp.commit(path, _meta().to_json(), "{}", SingleProcess())
    assert torch.equal(load_file(consolidate(path, tmp_path / "one.safetensors"))["head.3.weight"],
                       model.state_dict()["head.3.weight"])  # the genuine dir consolidates
    raw = json.loads((path / dcp.META).read_text())
    raw["spec"]["num_classes"] = 8_000_000
    (path / dcp.META).write_text(json.dumps(raw))
    out = _isolated(f"""
        result["rc"] = torchcls.cli.main(["consolidate", {str(path)!r}])
    """)
    assert out["rc"] == 2 and "num_classes must be an integer in [1, 100,000]" in out["stderr"], out
    assert "meta.json" in out["stderr"] and "Traceback" not in out["stderr"]
    assert out["grew_mb"] < RSS_BOUND_MB and out["seconds"] < 30, out


# -- the checks, one by one -------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, message", [
    (lambda r: r["spec"].update(num_classes=-1), "num_classes"),
    (lambda r: r["spec"].update(num_classes=2.0), "num_classes"),
    (lambda r: r["spec"].update(num_classes=True), "num_classes"),
    (lambda r: r["spec"].update(in_chans=10**6), "in_chans"),
    (lambda r: r["spec"].update(img_size=100_000), "img_size"),
    (lambda r: r["spec"].update(exits=10**9), "exits"),
    (lambda r: r["spec"].update(drop_rate=float("inf")), "Infinity|drop_rate"),
    (lambda r: r["spec"].update(name="x" * 300), "model name"),
    (lambda r: r["spec"].update(extra=1), "unknown model-spec field"),
    (lambda r: r.update(classes=["a"]), "one class name for each"),
    (lambda r: r.update(classes=["a" * 2000, "b"]), "class name"),
    (lambda r: r.update(thresholds=[0.5]), "thresholds"),
    (lambda r: r["preprocess"].update(crop_pct=1e-9), "crop_pct"),
    (lambda r: r["preprocess"].update(mean=[0.5] * 10**5), "mean and std"),
    (lambda r: r["preprocess"].update(std=[0, 0, 0]), "mean and std"),
    (lambda r: r["preprocess"].update(channels=1), "channels"),
    (lambda r: r["config"].update(data={"task": "x"}), "task"),
    (lambda r: r.update(step=-3), "step"),
    (lambda r: r["config"].update(data=_deep(20)), "deeper"),
    (lambda r: r.pop("spec"), "lacks spec"),
])
def test_each_field_out_of_bounds_is_a_user_error_naming_the_file(tmp_path: Path, edit, message: str) -> None:
    bad = _tampered(_checkpoint(tmp_path / "ok.safetensors"), tmp_path / "bad.safetensors", edit)
    with pytest.raises(UserError, match=message) as e:
        load_model(bad)
    assert str(bad) in str(e.value)


def test_a_model_the_meta_device_cannot_build_is_held_to_its_classifier(tmp_path: Path) -> None:
    """torchvision's RegNets compute their widths with tensor values: no meta-device build, so the file must
    at least hold a classifier of num_classes rows before the CPU build."""
    spec = ModelSpec("tv/regnet_y_400mf", 1000, 3, 32)
    assert meta_shapes(spec) is None and meta_shapes(SPEC) is not None
    with pytest.raises(UserError, match="no classifier weight of 1000 rows"):
        fitted_model(spec, {"fc.weight": (2, 440), "fc.bias": (2,)}, "x.safetensors")
    model = fitted_model(ModelSpec("tv/regnet_y_400mf", 2, 3, 32), {"fc.weight": (2, 440), "fc.bias": (2,)}, "x")
    assert model.fc.out_features == 2  # (the full comparison of every key follows in load_weights_into)


def test_total_elements_and_ranks_are_bounded() -> None:
    with pytest.raises(UserError, match="MAX_PARAMETERS"):
        check_sizes({"a": (MAX_PARAMETERS // 2 + 1,), "b": (MAX_PARAMETERS // 2 + 1,)}, "x")
    with pytest.raises(UserError, match="dims"):
        check_sizes({"a": (1,) * 64}, "x")
    with pytest.raises(UserError, match="MAX_PARAMETERS"):  # no quadratic product of huge dims
        check_sizes({"a": (2**62,) * 8}, "x")


def test_training_refuses_a_spec_it_could_not_read_back() -> None:
    with pytest.raises(UserError, match="num_classes"):
        create_model(ModelSpec("smallnet", MAX_CLASSES + 1, 3, 32))


# -- property: whatever the metadata JSON holds, a UserError or a checkpoint meta --------------------------
_BASE = json.loads(_meta().to_json())
_FIELDS = [("spec", k) for k in _BASE["spec"]] + [("preprocess", k) for k in _BASE["preprocess"]] + \
    [(None, k) for k in _BASE]


_hostile = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
              st.sampled_from([10**18, 2**63, -(2**63) - 1, 8_000_000, 0, -1]),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
              st.integers(1, 200_000).map(lambda n: "x" * n), st.integers(1, 3000).map(_deep)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(_FIELDS), value=_hostile)
def test_meta_json_property_user_error_or_meta(field, value) -> None:
    raw = json.loads(json.dumps(_BASE))
    section, key = field
    (raw[section] if section else raw)[key] = value
    try:
        text = json.dumps(raw)
    except RecursionError:  # (the encoder's own limit: no file can hold it this way)
        return
    before, watch = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, Stopwatch()
    try:
        meta = CheckpointMeta.from_json(text, "meta.json")
    except UserError as e:
        assert "meta.json" in str(e)
    else:
        assert 1 <= meta.spec.num_classes <= MAX_CLASSES and len(meta.classes) == meta.spec.num_classes
    assert watch.seconds() < 5
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < RSS_BOUND_MB


@settings(max_examples=100, deadline=None)
@given(text=st.one_of(st.binary(max_size=300), st.text(max_size=300),
                      st.integers(0, len(_meta().to_json())).map(lambda n: _meta().to_json()[:n])))
def test_meta_json_property_any_bytes(text) -> None:
    try:
        CheckpointMeta.from_json(text, "meta.json")
    except UserError:
        pass


@pytest.mark.parametrize("text, says", [
    (rb'"\ud800"', "not Unicode text"),  # JSON can spell a lone surrogate; no later .encode() survives one
    (rb'{"\udc00": 1}', "not Unicode text"),
    (b"1e999999", "does not fit a float"),  # parses to inf without a float hook
    (b"[" + b"1," * 600_000 + b"1]", "refused before parsing"),  # scalars are counted before the parse too
])
def test_bounded_json_refuses_what_a_later_step_would_choke_on(text, says):
    from torchcls.bounded_json import load_bounded
    from torchcls.checkpoint.meta_check import META_BOUNDS

    with pytest.raises(UserError, match=says):
        load_bounded(text, META_BOUNDS, "meta.json")
