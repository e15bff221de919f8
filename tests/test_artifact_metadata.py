"""An exported artifact's torchcls metadata (ONNX metadata_props, the .pte/.pt2 side data) is data from a
file: every value is checked against its bound before anything is built from it."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bounds_check import Stopwatch
from torchcls.artifacts.targets.base import MAX_BATCH, ArtifactInfo
from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError

GOOD = ArtifactInfo("run", "onnx", ["cat", "dog"], Preprocess(32, 3, (0.5,) * 3, (0.25,) * 3), 8, "fp32")


def _with(**changes) -> str:
    raw = json.loads(GOOD.to_json())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            raw[outer][inner] = value
        else:
            raw[key] = value
    return json.dumps(raw)


def test_a_good_artifacts_metadata_round_trips():
    assert ArtifactInfo.from_json(GOOD.to_json(), "m.onnx") == GOOD


@pytest.mark.parametrize("changes, says", [
    ({"classes": [f"c{i}" for i in range(200_001)]}, "class name"),
    ({"classes": []}, "class name"),
    ({"classes": ["x" * 2000, "y"]}, "class name"),
    ({"classes": ["x" * 5000, "y"]}, "string of 5000 characters"),
    ({"max_batch": 10**9}, f"[1, {MAX_BATCH}]"),
    ({"max_batch": True}, "integer"),
    ({"exits": 10**6}, "integer"),
    ({"preprocess.img_size": 10**6}, "img_size"),
    ({"preprocess.channels": 4000}, "channels"),
    ({"preprocess.mean": [float("nan")] * 3}, "NaN"),
    ({"preprocess.mean": [1e9] * 3}, "mean and std"),
    ({"thresholds": [0.5] * 3}, "thresholds"),
    ({"name": "n" * 1000}, "unreadable"),
    ({"preprocess": "224"}, "preprocess"),
])
def test_out_of_bound_metadata_is_refused_naming_the_file(changes, says):
    with pytest.raises(UserError, match="m.onnx") as e:
        ArtifactInfo.from_json(_with(**changes), "m.onnx")
    assert says in str(e.value)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
                    max_leaves=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["name", "classes", "preprocess", "max_batch", "precision", "exits", "thresholds",
                              "task", "preprocess.img_size", "preprocess.mean", "preprocess.crop_pct"]), value=JSON)
def test_any_value_in_any_field_loads_or_is_a_user_error(field, value):
    watch = Stopwatch()
    try:
        info = ArtifactInfo.from_json(_with(**{field: value}), "m.onnx")
    except UserError:
        return
    finally:
        assert watch.seconds() < 2
    assert 1 <= info.max_batch <= MAX_BATCH and 1 <= len(info.classes) and info.preprocess.img_size <= 2048
