"""Export: AOTInductor and ONNX artifacts of a real trained SmallNet, their parity with eager, the
loader's checks, the C++ runner, and the compile policy. Each artifact is compiled once per session."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from torchcls.artifacts import compile_for_inference, export, load_artifact
from torchcls.artifacts.targets.onnx import OnnxArtifact
from torchcls.checkpoint.files import load_model
from torchcls.errors import UserError

pytestmark = pytest.mark.slow
MAX_BATCH = 8
CPP_DIR = Path(__file__).resolve().parent.parent / "cpp"


@pytest.fixture(scope="session")
def classify_pt2(tmp_path_factory) -> Path:
    """The C++ runner, built once per session with CMake against the torch wheel's libtorch."""
    if not (shutil.which("cmake") and shutil.which("c++")):
        pytest.fail("the C++ runner test needs cmake and a C++ compiler (apt-get install cmake g++)")
    build = tmp_path_factory.mktemp("cpp-build")
    prefix = torch.utils.cmake_prefix_path
    for cmd in (["cmake", "-S", str(CPP_DIR), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}"],
                ["cmake", "--build", str(build)]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return build / "classify_pt2"


def _held_out(trained_run: Path) -> tuple[torch.Tensor, torch.nn.Module]:
    from torchcls.artifacts.parity import held_out_images

    model, meta = load_model(trained_run)
    images, _ = held_out_images(meta, 100)
    return images, model


@pytest.mark.parametrize("target", ["aoti", "onnx"])
def test_artifact_matches_eager_and_carries_metadata(target, request, trained_run):
    path = request.getfixturevalue("aoti_export").path if target == "aoti" else request.getfixturevalue("onnx_path")
    parity = json.loads((path.parent / "parity.json").read_text())
    assert parity["n"] == 20 and parity["top1_agreement"] == 1.0 and parity["passed"]
    assert parity["max_abs_diff"] < 1e-4 and parity["target"] == target

    art = load_artifact(path)
    _, meta = load_model(trained_run)
    assert art.info.target == target and art.info.name == "shapes" and art.info.max_batch == MAX_BATCH
    assert art.info.classes == meta.classes and art.info.preprocess == meta.preprocess
    images, model = _held_out(trained_run)
    with torch.no_grad():
        for n in (1, 5, MAX_BATCH):  # any batch within the bound, with one compiled artifact
            torch.testing.assert_close(art(images[:n]), model(images[:n]), atol=1e-4, rtol=1e-4)
    assert parity["batch1_images"] == 16  # parity ran these one at a time: through the .pt2's batch-1 model
    if target == "aoti":
        assert parity["models"] == ["model", "batch1"] and art.batch1 is not None
        one = images[:1]
        torch.testing.assert_close(art.batch1(one)[0], model(one), atol=1e-4, rtol=1e-4)


def test_aoti_single_images_run_on_the_batch1_model(aoti_export, trained_run):
    art = load_artifact(aoti_export.path)
    images, _ = _held_out(trained_run)
    calls = []
    runner = art.batch1
    art.batch1 = lambda x: calls.append(x.shape[0]) or runner(x)
    art(images[:1])
    art(images[:3])
    assert calls == [1]  # batches of several images run on the dynamic model


def test_aoti_package_of_one_model_loads_and_runs_batch1_on_it(trained_run, tmp_path):
    """A package bounded at batch 1 is static already (one model, as every package before the batch-1 model)."""
    result = export(trained_run, target="aoti", max_batch=1, out=tmp_path / "one.pt2", precision="fp32")
    art = load_artifact(result.path)
    assert art.batch1 is None and "models" not in result.parity and result.parity["passed"]
    images, model = _held_out(trained_run)
    with torch.no_grad():
        torch.testing.assert_close(art(images[:1]), model(images[:1]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target", ["aoti", "onnx"])
def test_artifact_rejects_bad_input(target, request):
    path = request.getfixturevalue("aoti_export").path if target == "aoti" else request.getfixturevalue("onnx_path")
    art = load_artifact(path)
    good = torch.zeros(2, 3, 32, 32)
    with pytest.raises(UserError, match=r"accepts 1 to 8"):
        art(torch.zeros(MAX_BATCH + 1, 3, 32, 32))  # AOTI itself would run it silently
    with pytest.raises(UserError, match=r"shape \(N, 3, 32, 32\)"):
        art(torch.zeros(2, 1, 32, 32))
    with pytest.raises(UserError, match="float32"):
        art(good.double())
    assert art(good).shape == (2, 2)


def test_cpp_runner_equals_python(aoti_export, classify_pt2, trained_run, tmp_path):
    art = load_artifact(aoti_export.path)
    pre = art.info.preprocess
    mean, std = torch.tensor(pre.mean).view(1, -1, 1, 1), torch.tensor(pre.std).view(1, -1, 1, 1)
    images, _ = _held_out(trained_run)
    pixels = (images[:6] * std + mean).contiguous()  # back to [0, 1] pixels: C++ normalises with the metadata
    pixels.numpy().tofile(tmp_path / "px.f32")
    out = subprocess.run([str(classify_pt2), str(aoti_export.path), str(tmp_path / "px.f32")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    expected = art((pixels - mean) / std)
    torch.testing.assert_close(torch.tensor([r["logits"] for r in rows]), expected, atol=1e-5, rtol=1e-5)
    assert [r["label"] for r in rows] == [art.info.classes[i] for i in expected.argmax(1).tolist()]

    torch.zeros(MAX_BATCH + 1, 3, 32, 32).numpy().tofile(tmp_path / "big.f32")
    out = subprocess.run([str(classify_pt2), str(aoti_export.path), str(tmp_path / "big.f32")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "accepts 1 to 8" in out.stderr


def test_failed_parity_leaves_no_artifact(trained_run, tmp_path, monkeypatch):
    """A runtime that returns wrong logits (fault injected into the loaded artifact) must not yield a file."""
    import dataclasses

    from torchcls.artifacts.targets import TARGETS

    class Broken(OnnxArtifact):
        def _run(self, x):
            return tuple(-t for t in super()._run(x))

    monkeypatch.setitem(TARGETS, "onnx", dataclasses.replace(TARGETS["onnx"], load=Broken))
    out = tmp_path / "out" / "model.onnx"
    with pytest.raises(UserError, match="parity failed"):
        export(trained_run, target="onnx", max_batch=4, out=out)
    assert not out.parent.exists()  # no artifact, no parity.json, no temp file: the folder it made is gone too


def test_export_option_errors(trained_run, tmp_path):
    with pytest.raises(UserError, match="fp32 only"):
        export(trained_run, target="onnx", precision="bf16", out=tmp_path / "m.onnx")
    with pytest.raises(UserError, match="must end in .pt2"):
        export(trained_run, target="aoti", out=tmp_path / "m.onnx")
    with pytest.raises(UserError, match="--max-batch 0"):
        export(trained_run, max_batch=0)
    with pytest.raises(UserError, match="--min-agreement"):
        export(trained_run, min_agreement=1.5)
    with pytest.raises(UserError, match="does not exist"):
        export(tmp_path / "missing.safetensors")


def test_load_artifact_errors(tmp_path, trained_run):
    import onnx
    from onnx import TensorProto, helper

    with pytest.raises(UserError, match="does not exist"):
        load_artifact(tmp_path / "none.pt2")
    (tmp_path / "junk.pt2").write_bytes(b"not a package")
    with pytest.raises(UserError, match=r"refusing to load it: a \.pt2 is native code"):
        load_artifact(tmp_path / "junk.pt2")
    with pytest.raises(UserError, match="not a loadable AOTInductor package"):
        load_artifact(tmp_path / "junk.pt2", trust=True)
    (tmp_path / "junk.onnx").write_bytes(b"not onnx")
    with pytest.raises(UserError, match="not a loadable ONNX model"):
        load_artifact(tmp_path / "junk.onnx")
    (tmp_path / "model.txt").write_text("x")
    with pytest.raises(UserError, match="unknown artifact type"):
        load_artifact(tmp_path / "model.txt")
    # A valid ONNX model that torchcls did not write: no class names or preprocessing
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "foreign.onnx")
    with pytest.raises(UserError, match="without torchcls metadata"):
        load_artifact(tmp_path / "foreign.onnx")
    eager = load_artifact(trained_run)
    assert eager.info.target == "eager" and eager.info.max_batch == 256


def test_predict_accepts_artifacts(aoti_export, onnx_path, trained_run):
    from torchcls.prediction import predict

    folder = trained_run.parent.parent / "shapes"
    eager = predict(trained_run, [folder / "circle"], topk=2, precision="fp32")  # as the artifacts (auto: bf16?)
    for path in (aoti_export.path, onnx_path):
        preds = predict(path, [folder / "circle"], topk=2)
        assert [i["top"][0]["label"] for i in preds.items] == [i["top"][0]["label"] for i in eager.items]
        got = torch.tensor([[t["prob"] for t in i["top"]] for i in preds.items])
        torch.testing.assert_close(got, torch.tensor([[t["prob"] for t in i["top"]] for i in eager.items]),
                                   atol=1e-4, rtol=0)


def test_bf16_capture_casts_inside(trained_run):
    """bf16 artifacts take and return float32; the graph inside runs in bf16 (checked without compiling)."""
    from torchcls.artifacts.exporter import capture
    from torchcls.artifacts.targets.base import ArtifactInfo

    images, model = _held_out(trained_run)
    _, meta = load_model(trained_run)
    info = ArtifactInfo("shapes", "aoti", meta.classes, meta.preprocess, MAX_BATCH, "bf16")
    ep = capture(load_model(trained_run)[0], info)
    assert any(getattr(n.meta.get("val"), "dtype", None) == torch.bfloat16 for n in ep.graph.nodes)
    with torch.no_grad():
        got, ref = ep.module()(images[:MAX_BATCH]), model(images[:MAX_BATCH])
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.25 and (got.argmax(1) == ref.argmax(1)).float().mean() >= 0.75


def test_compile_for_inference_pads_partial_batches(trained_run):
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    # config.patch, not monkeypatch: monkeypatch's undo leaves Inductor's config without the key (and every
    # later AOTInductor build fails). Restored after: the policy sets freezing globally.
    with torch._inductor.config.patch(freezing=False):
        torch._dynamo.reset()
        counters.clear()
        images, model = _held_out(trained_run)
        with torch.no_grad():
            expected = model(images[:4])
        compiled, code = run_and_get_code(compile_for_inference, model, images[:3], "cpu", "fp32", 4, (4,))
        assert any("convolution_pointwise" in c for c in code), "freezing did not apply: no prepacked oneDNN convolutions"
        for n in (3, 1, 4):  # all padded to the one bucket of 4: a single compiled graph
            torch.testing.assert_close(compiled(images[:n]), expected[:n], atol=1e-4, rtol=1e-4)
        assert counters["stats"]["unique_graphs"] == 1
        with pytest.raises(UserError, match="accepts 1 to 4"):
            compiled(images[:5])
        torch._dynamo.reset()


def test_auto_falls_back_to_fp32_when_bf16_fails_parity(trained_run, tmp_path, monkeypatch):
    """--precision auto never trades a working fp32 artifact for a reduced-precision one that fails its own
    parity gate: the bf16 build is refused (here its runtime is made wrong), fp32 is built and published, and
    parity.json says what auto tried and why it was not kept. The held-out images are read once for both
    attempts, and the failed one leaves no folder behind. Explicit bf16 still refuses, leaving nothing."""
    import dataclasses

    from torchcls.artifacts import exporter
    from torchcls.artifacts.targets import TARGETS
    from torchcls.artifacts.targets.aoti import AOTIArtifact
    from torchcls.precision import hardware

    class WrongInBf16(AOTIArtifact):
        def _run(self, x):
            out = super()._run(x)
            return tuple(-t for t in out) if self.info.precision == "bf16" else out

    reads = []

    def counted(*args, **kwargs):
        reads.append(args[1])
        return held_out(*args, **kwargs)

    held_out = exporter.held_out_images
    monkeypatch.setattr(exporter, "held_out_images", counted)
    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: (True, "this CPU computes bf16 natively (test)"))
    monkeypatch.setitem(TARGETS, "aoti", dataclasses.replace(TARGETS["aoti"], load=WrongInBf16))
    # A copy of the run without its export/ folder (other tests export there): what is made in it is this test's.
    run = shutil.copytree(trained_run, tmp_path / "run", symlinks=True, ignore=shutil.ignore_patterns("export"))
    # max_batch 1: one compiled model per package (from 2 on a batch-1 model is compiled beside the batched one)
    result = export(run, target="aoti", max_batch=1)
    parity = json.loads(result.parity_path.read_text())
    assert result.path == run / "export" / "aoti-fp32" / "model.pt2" and result.path.is_file()
    assert parity["precision"] == "fp32" and parity["passed"]
    assert parity["precision_requested"] == "auto" and "failed parity" in parity["precision_reason"]
    tried = parity["precision_fallback"]
    assert tried["precision"] == "bf16" and tried["top1_agreement"] < tried["min_agreement"]
    assert sorted(p.name for p in (run / "export").iterdir()) == ["aoti-fp32"]  # no empty aoti-bf16/
    assert len(reads) == 1  # one read of the held-out images for both attempts
    with pytest.raises(UserError, match="parity failed"):
        export(trained_run, target="aoti", precision="bf16", max_batch=1, out=tmp_path / "bf16" / "model.pt2")
    assert not (tmp_path / "bf16").exists()  # the folder that attempt made is gone with it


def test_auto_keeps_eager_bf16_only_where_it_agrees_with_fp32(trained_run, tmp_path, monkeypatch):
    """A checkpoint served or predicted with --precision auto runs bf16 only when bf16 agrees with fp32 on
    held-out images as a bf16 export must; otherwise (or with no held-out images on this machine) fp32."""
    from torchcls.artifacts import parity
    from torchcls.artifacts.auto_check_store import CACHE_ENV
    from torchcls.precision import hardware

    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: (True, "this CPU computes bf16 natively (test)"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    kept = load_artifact(trained_run)
    assert kept.info.precision == "bf16" and "agrees with fp32 on" in kept.choice.reason
    monkeypatch.setitem(parity.DEFAULT_MIN_AGREEMENT, "bf16", 1.01)  # no agreement is enough
    refused = load_artifact(trained_run)  # the remembered measurement, held to today's bound
    assert refused.info.precision == "fp32" and "needed): fp32 runs (cached check" in refused.choice.reason
    monkeypatch.setitem(parity.DEFAULT_MIN_AGREEMENT, "bf16", 0.99)

    def no_data(*args, **kwargs):  # a serving machine without the training data
        raise UserError("the data set is not on this machine")

    monkeypatch.setattr(parity, "held_out_images", no_data)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "another-cache"))  # never checked on this "machine"
    blind = load_artifact(trained_run)
    assert blind.info.precision == "fp32" and "no held-out images here" in blind.choice.reason
    assert load_artifact(trained_run, precision="bf16").info.precision == "bf16"  # asked for: as asked
