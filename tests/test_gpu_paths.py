"""The GPU paths that can be checked without a GPU: device names, the refusals of --device cuda on a CPU
host, the artifact device check (a .pt2 whose metadata says CUDA is refused here, read the way a real CUDA
build is read) and old artifacts without device metadata. The device check itself: tests/test_gpu_check.py."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import make_image_folder, tiny_config
from torchcls.artifacts import load_artifact
from torchcls.artifacts.placement import compiled_device, cpu_only, onnx_providers
from torchcls.artifacts.targets.aoti import package_metadata
from torchcls.cli import main
from torchcls.devices import BuildDevice, parse_device, resolve_device
from torchcls.errors import UserError

REPO = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="checks the refusals of a machine without a GPU")


def test_device_names_parse():
    assert parse_device("auto") == "auto"
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device("CUDA") == torch.device("cuda")
    assert parse_device("cuda:3") == torch.device("cuda", 3)
    for bad in ("gpu", "cuda:", "cuda:x", "cpu:1", "mps", "cuda:-1", ""):
        with pytest.raises(UserError, match="auto, cpu, cuda or cuda:N"):
            parse_device(bad)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if not NO_GPU else "cpu")
    assert BuildDevice.of(torch.device("cpu")) == BuildDevice("cpu", "", "")


@needs_no_gpu
def test_cuda_without_gpu_is_refused():
    for name in ("cuda", "cuda:1"):
        with pytest.raises(UserError, match="needs an NVIDIA GPU with a working CUDA driver.*--device cpu"):
            resolve_device(name)
    with pytest.raises(UserError, match="onnxruntime-gpu"):  # the CPU-only onnxruntime has no CUDA provider
        onnx_providers("cuda", ["CPUExecutionProvider"])
    assert onnx_providers("auto", ["CPUExecutionProvider"]) == (torch.device("cpu"), ["CPUExecutionProvider"])
    with pytest.raises(UserError, match="ExecuTorch programs run on the CPU"):
        cpu_only("cuda:0", "ExecuTorch programs")


def test_compiled_device_rules(tmp_path):
    pt2 = tmp_path / "m.pt2"
    assert compiled_device("cpu", "", "", pt2, "auto") == torch.device("cpu")
    with pytest.raises(UserError, match="built for the CPU.*--device cuda"):
        compiled_device("cpu", "", "", pt2, "cuda")
    with pytest.raises(UserError, match=r"built for CUDA compute capability 9\.0 \(NVIDIA H200\).*cannot run on the CPU"):
        compiled_device("cuda", "9.0", "NVIDIA H200", pt2, "cpu")
    if NO_GPU:
        with pytest.raises(UserError, match=r"9\.0 \(NVIDIA H200\) and needs that GPU, but this machine has no"):
            compiled_device("cuda", "9.0", "NVIDIA H200", pt2, "auto")


def _run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A SmallNet trained for one epoch on 16 shape images (32 px): a real run dir."""
    from torchcls.training import train

    base = tmp_path_factory.mktemp("gpu_paths")
    return train(tiny_config(make_image_folder(base / "shapes", per_class=8), base / "runs", epochs=1)).run_dir


@pytest.fixture(scope="module")
def cpu_pt2(aoti_export) -> Path:
    """A real CPU export (batch 1-8, 3x32x32, 2 classes): the session's one (conftest), as an AOTInductor
    compile is the slowest step of a test and these tests only read the package or copy it."""
    return aoti_export.path


def rewrite_metadata(src: Path, dst: Path, **changes: str) -> None:
    """Copy a .pt2 with its metadata files changed. AOTInductor writes the metadata (ours under 'torchcls',
    its own AOTI_* keys) into <name>_metadata.json files in the package; load_metadata_from_package reads
    them from there, as AOTIArtifact does before loading any compiled code. A real CUDA build carries
    AOTI_DEVICE_KEY=cuda and our device/compute_capability/gpu in the same files."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename.endswith("_metadata.json"):
                meta = json.loads(data)
                info = json.loads(meta["torchcls"])
                for key, value in changes.items():
                    if key.startswith("AOTI_"):
                        meta[key] = value
                    elif value is None:
                        info.pop(key, None)
                    else:
                        info[key] = value
                meta["torchcls"] = json.dumps(info)
                data = json.dumps(meta).encode()
            zout.writestr(item, data)


@pytest.mark.slow
def test_cuda_artifact_refused_on_cpu_host(cpu_pt2, tmp_path, capsys):
    built = package_metadata(cpu_pt2)
    assert json.loads(built["torchcls"])["device"] == "cpu" and built["AOTI_DEVICE_KEY"] == "cpu"
    assert built["torchcls.device"] == "cpu"
    foreign = tmp_path / "cuda.pt2"
    rewrite_metadata(cpu_pt2, foreign, device="cuda", compute_capability="9.0", gpu="NVIDIA H200",
                     AOTI_DEVICE_KEY="cuda", AOTI_COMPUTE_CAPABILITY="90")
    assert json.loads(package_metadata(foreign)["torchcls"])["compute_capability"] == "9.0"
    if NO_GPU:
        with pytest.raises(UserError, match=r"built for CUDA compute capability 9\.0 \(NVIDIA H200\) and needs that"):
            load_artifact(foreign, trust=True)
    with pytest.raises(UserError, match="cannot run on the CPU"):
        load_artifact(foreign, device="cpu", trust=True)
    images = tmp_path / "img.png"
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 10, 10)).save(images)
    code, err = _run_cli(["predict", str(foreign), str(images), "--device", "cpu", "--trust-artifact"], capsys)
    assert code != 0 and "built for CUDA compute capability 9.0" in err and "--device cuda" in err
    # The CPU build itself: runs on the CPU, refuses cuda (before any GPU check: the artifact cannot run there).
    art = load_artifact(cpu_pt2, device="cpu")
    assert art.device == torch.device("cpu") and art.info.device == "cpu"
    assert art(torch.zeros(3, 3, 32, 32)).shape == (3, 2)
    code, err = _run_cli(["predict", str(cpu_pt2), str(images), "--device", "cuda"], capsys)
    assert code != 0 and "was built for the CPU" in err and "--device cuda" in err


@pytest.mark.slow
def test_old_artifact_without_device_metadata_loads(cpu_pt2, tmp_path):
    old = tmp_path / "old.pt2"
    rewrite_metadata(cpu_pt2, old, device=None, compute_capability=None, gpu=None)
    assert "device" not in json.loads(package_metadata(old)["torchcls"])
    art = load_artifact(old, trust=True)  # rewritten here: not what export published
    assert art.info.device == "cpu" and art.device == torch.device("cpu")
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(art(x), load_artifact(cpu_pt2)(x))


@needs_no_gpu
def test_cli_device_cuda_without_gpu(tmp_path, capsys, tiny_run):
    code, err = _run_cli(["export", str(tiny_run), "--device", "cuda", "--out", str(tmp_path / "m.pt2")], capsys)
    assert code != 0 and "needs an NVIDIA GPU" in err and "--device cpu" in err
    assert not (tmp_path / "m.pt2").exists()
    code, err = _run_cli(["export", str(tiny_run), "--device", "gpu0"], capsys)
    assert code != 0 and "is not a device name" in err
    code, err = _run_cli(["export", str(tiny_run), "--target", "onnx", "--autotune"], capsys)
    assert code != 0 and "--autotune applies to --target aoti only" in err
    code, err = _run_cli(["export", str(tiny_run), "--target", "executorch", "--device", "cuda"], capsys)
    assert code != 0 and "executorch programs run on the CPU" in err
    image = next((tiny_run.parent.parent / "shapes").rglob("*.png"))
    code, err = _run_cli(["predict", str(tiny_run), str(image), "--device", "cuda:1"], capsys)
    assert code != 0 and "needs an NVIDIA GPU" in err


@needs_no_gpu
def test_serve_device_cuda_without_gpu_exits_cleanly(tiny_run, capsys):
    code, err = _run_cli(["serve", str(tiny_run), "--device", "cuda", "--port", "0"], capsys)
    assert code != 0 and "needs an NVIDIA GPU" in err and "--device cpu" in err
