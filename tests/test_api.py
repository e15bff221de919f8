"""The Python API: each public function stays callable after any sub-package has been imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torchcls
from conftest import tiny_config


@pytest.mark.slow
def test_api_functions_callable_in_any_order(shapes_dir: Path, tmp_path: Path) -> None:
    # The sequence that broke: predict, then train (the sub-package used to replace the function).
    first = torchcls.train(tiny_config(shapes_dir, tmp_path / "runs", "first", epochs=1))
    preds = torchcls.predict(first.run_dir, [shapes_dir / "circle"])
    assert len(preds.items) == 16 and not preds.skipped
    second = torchcls.train(tiny_config(shapes_dir, tmp_path / "runs", "second", epochs=1))
    report = torchcls.evaluate(second.run_dir, split="val")
    assert report["n"] > 0 and 0.0 <= report["top1"] <= 1.0
    assert json.loads((second.run_dir / "eval.json").read_text())["top1"] == report["top1"]
    art = torchcls.export(second.run_dir, target="onnx", max_batch=4, parity_images=8)
    assert art.path.is_file() and 0 < art.parity["n"] <= 8  # the held-out split has 6 images
    assert torchcls.predict(art.path, [shapes_dir / "square"]).items[0]["top"][0]["label"] in ("circle", "square")
    assert torchcls.load_artifact(art.path).info.max_batch == 4
    # Every API name is still the function, not a module.
    for name in ("train", "evaluate", "predict", "export", "load_artifact"):
        assert callable(getattr(torchcls, name)), name


def test_api_names_stay_functions_after_first_use() -> None:
    """torchcls.demo and torchcls.explain are functions defined in submodules of the same name: importing
    the submodule sets the package attribute to the module, so the second lookup used to be the module."""
    import subprocess
    import sys

    code = ("import torchcls, types; names = ('demo', 'explain', 'train', 'export');"
            "assert all(callable(getattr(torchcls, n)) for n in names);"
            "assert all(callable(getattr(torchcls, n)) and not isinstance(getattr(torchcls, n), types.ModuleType)"
            " for n in names)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
