"""The CUDA AOTInductor export, taken apart so that a crash names its phase. The device check runs each
sub-command in its own process (PYTHONFAULTHANDLER=1: a SIGSEGV prints the Python frame it hit):

    preflight  CUDA_HOME, nvcc, the CUDA headers and libcuda the generated wrapper compiles and links against,
               the host compiler; written to --json, never fails
    smoke      a one-layer model (conv, BN, linear) compiled for CUDA with and without freezing, each package
               loaded and run in a fresh process, then in this one
    compile    torchcls's own capture and AOTInductor build of a checkpoint (what `torchcls export` does)
               into --artifact, with torchcls's metadata; the generated sources are kept in --sources
    load       that package in a fresh process: its metadata, AOTInductor's loader, a first batch on the
               GPU, then torchcls's loader and a batch through its pinned staging buffer
    parity     eager against the package on held-out images: parity.json beside it; when it passes, the
               package is recorded as exported on this machine (so serve and the benchmarks load it)
    backtrace  (when load died) `load --via aoti` again under cuda-gdb: the native frames of the crash

Every phase prints "PHASE <name>" (flushed) before it starts and writes its figures to --json as it goes:
the last PHASE line of a crashed process is where it died. `--device cpu` runs compile, load and parity on
a CPU build: the rehearsal of this script, not of CUDA.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

T0 = time.perf_counter()
SOURCE_SUFFIXES = (".cpp", ".h", ".json", ".txt", ".cmake", ".py")  # what a reader of the build needs; no .so/.cubin


class Record:
    def __init__(self, path: str):
        self.path, self.data = Path(path), {}

    def set(self, **values: Any) -> None:
        self.data.update(values)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def phase(name: str) -> None:
    print(f"PHASE {name} [{time.perf_counter() - T0:.1f} s]", flush=True)
    print(f"PHASE {name}", file=sys.stderr, flush=True)


def _run(cmd: list[str], line: int = 0) -> str:
    """One line of what `cmd` prints (its first by default), or why it could not run."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        lines = (out.stdout or out.stderr).strip().splitlines()
        return lines[line] if lines else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not runnable: {e}"


def _ldconfig_libcuda() -> list[str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({line.split("=>")[-1].strip() for line in out.splitlines() if "libcuda.so" in line})


def preflight(args, rec: Record) -> int:
    """What AOTInductor's CUDA build needs from the machine, as found (missing pieces are named, not fatal)."""
    import ctypes.util
    import glob

    import torch
    from torch.utils import cpp_extension

    phase("preflight")
    home = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME
    include_dirs = [d for d in (f"{home}/include" if home else None, *glob.glob(
        str(Path(torch.__file__).parents[1] / "nvidia" / "*" / "include"))) if d]
    headers = {h: [d for d in include_dirs if Path(d, h).is_file()] for h in ("cuda.h", "cuda_runtime_api.h")}
    libcuda = sorted({*glob.glob("/usr/lib/x86_64-linux-gnu/libcuda.so*"), *glob.glob("/usr/local/nvidia/lib64/libcuda.so*"),
                      *glob.glob("/usr/local/cuda*/lib64/stubs/libcuda.so")})
    rec.set(torch=torch.__version__, cuda_build=torch.version.cuda, cuda_available=torch.cuda.is_available(),
            gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            cuda_home_env=os.environ.get("CUDA_HOME"), cuda_home=home,
            nvcc=shutil.which("nvcc") or (f"{home}/bin/nvcc" if home and Path(f"{home}/bin/nvcc").exists() else None),
            nvcc_version=_run(["nvcc", "--version"], -2) if shutil.which("nvcc") else None,
            headers=headers, headers_missing=[h for h, where in headers.items() if not where],
            libcuda=libcuda, libcuda_ldconfig=_ldconfig_libcuda(), libcuda_found=ctypes.util.find_library("cuda"),
            libcuda_unversioned=any(p.endswith("libcuda.so") for p in libcuda),
            cxx=_run([os.environ.get("CXX", "c++"), "--version"]), ld_library_path=os.environ.get("LD_LIBRARY_PATH"),
            inductor_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    return 0


class OneLayer:
    """conv + BN + ReLU + linear: the smallest model with what ResNet-50 asks of AOTInductor (a convolution,
    a foldable BatchNorm under freezing, a GEMM)."""

    @staticmethod
    def build():
        from torch import nn

        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(16, 10)).eval()


def _aoti_build(module, example, path: Path, freezing: bool) -> float:
    import torch

    t = time.perf_counter()
    ep = torch.export.export(module, (example,))
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs={"freezing": freezing})
    return time.perf_counter() - t


def smoke(args, rec: Record) -> int:
    """Compile the one-layer model both ways, then load each in a fresh process and here."""
    import torch

    device = torch.device(args.device)
    module = OneLayer.build().to(device)
    example = torch.randn(2, 3, 16, 16, device=device)
    with torch.no_grad():
        reference = module(example)
    out = Path(args.sources)
    out.mkdir(parents=True, exist_ok=True)
    for freezing in (True, False):
        name = f"freezing_{'on' if freezing else 'off'}"
        path = out / f"smoke_{name}.pt2"
        phase(f"smoke:{name}:compile")
        entry: dict[str, Any] = {"compile_s": round(_aoti_build(module, example, path, freezing), 1)}
        rec.set(**{name: entry})
        phase(f"smoke:{name}:load-in-child")
        child = subprocess.run([sys.executable, __file__, "run-package", "--artifact", str(path), "--device",
                                args.device], capture_output=True, text=True, timeout=300,
                               env=os.environ | {"PYTHONFAULTHANDLER": "1"})
        entry.update(child_returncode=child.returncode, child_tail=(child.stdout + child.stderr)[-1500:])
        rec.set(**{name: entry})
        phase(f"smoke:{name}:load-here")
        runner = torch._inductor.aoti_load_package(str(path))
        with torch.no_grad():
            got = runner(example)
        entry["max_abs_diff_here"] = float((got - reference).abs().max())
        rec.set(**{name: entry})
    return 0 if all(rec.data[n]["child_returncode"] == 0 for n in ("freezing_on", "freezing_off")) else 1


def run_package(args, rec: Record | None = None) -> int:
    """(The smoke test's child) load a package with AOTInductor's own API and run one batch."""
    import torch

    phase("child:load")
    runner = torch._inductor.aoti_load_package(args.artifact)
    phase("child:run")
    with torch.no_grad():
        out = runner(torch.randn(2, 3, 16, 16, device=args.device))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    print(f"ok {tuple(out.shape)}", flush=True)
    return 0


def _device(name: str):
    import torch

    device = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def compile_package(args, rec: Record) -> int:
    """torchcls's capture and AOTInductor build (artifacts/exporter.capture, targets/aoti.build) of --checkpoint."""
    import torch

    from torchcls.artifacts.exporter import capture
    from torchcls.artifacts.targets.aoti import build
    from torchcls.artifacts.targets.base import ArtifactInfo
    from torchcls.checkpoint.files import load_model, resolve_checkpoint
    from torchcls.devices import BuildDevice

    phase("compile:checkpoint")
    device, path = _device(args.device), Path(args.artifact)
    ckpt = resolve_checkpoint(args.checkpoint)
    model, meta = load_model(ckpt)
    built = BuildDevice.of(device)
    info = ArtifactInfo(ckpt.parent.parent.name, "aoti", list(meta.classes), meta.preprocess, args.max_batch, "fp32",
                        0, built.type, built.capability, built.gpu, task=meta.task, thresholds=meta.thresholds)
    rec.set(checkpoint=str(ckpt), model=meta.spec.name, device=str(device), gpu=built.gpu, freezing=not args.no_freeze)
    phase("compile:capture")
    t = time.perf_counter()
    ep = capture(model.to(device), info, device)
    rec.set(capture_s=round(time.perf_counter() - t, 1))
    phase("compile:aoti_compile_and_package")
    t = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    build(ep, info, path, {"source": str(ckpt), "model": meta.spec.name, "torch": torch.__version__},
          freezing=not args.no_freeze)
    rec.set(compile_s=round(time.perf_counter() - t, 1), package_bytes=path.stat().st_size)
    phase("compile:sources")
    rec.set(**keep_sources(path, Path(args.sources)))
    return 0


def keep_sources(package: Path, out: Path) -> dict[str, Any]:
    """The package's listing, and its generated sources (wrapper C++, kernels' metadata, build flags: no
    shared libraries, cubins or weights) as aoti_sources.tar.gz in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    archive = out / "aoti_sources.tar.gz"
    with zipfile.ZipFile(package) as z, tarfile.open(archive, "w:gz") as tar:
        listing = {i.filename: i.file_size for i in z.infolist()}
        for name in listing:
            if name.endswith(SOURCE_SUFFIXES):
                data = z.read(name)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return {"package_files": listing, "sources": str(archive), "sources_bytes": archive.stat().st_size}


def load(args, rec: Record) -> int:
    """--via aoti: AOTInductor's loader and a first batch already on the device; --via torchcls: load_artifact
    and a host batch through its pinned staging buffer. One loader per process."""
    import torch

    from torchcls.artifacts.targets.aoti import load_runner, package_metadata

    device, path = _device(args.device), Path(args.artifact)
    phase("load:metadata")
    meta = package_metadata(path)
    rec.set(aoti_metadata={k: v for k, v in meta.items() if k.startswith("AOTI")})
    info = json.loads(meta["torchcls"])
    pre = info["preprocess"]
    shape = (3, pre["channels"], pre["img_size"], pre["img_size"])
    if args.via == "aoti":
        phase("load:AOTIModelPackageLoader")
        runner = load_runner(path, device.index if device.type == "cuda" else -1)
        phase("load:first-batch")
        out = runner(torch.randn(*shape, device=device))[0]  # (logits,): the flat outputs
    else:
        from torchcls.artifacts import load_artifact

        phase("load:torchcls.load_artifact")
        artifact = load_artifact(path, device=args.device, trust=True)  # built by this check, not published yet
        phase("load:first-batch-host-input")
        out = artifact(torch.randn(*shape))
    if device.type == "cuda":
        phase("load:synchronize")
        torch.cuda.synchronize()
    rec.set(**{f"{args.via}_output_shape": list(out.shape), f"{args.via}_finite": bool(torch.isfinite(out).all())})
    return 0


def parity(args, rec: Record) -> int:
    """Eager against the package on --images held-out images; parity.json beside the package; when it passes,
    the package is recorded as exported here (torchcls.provenance.trust), as `torchcls export` does."""
    from torchcls.artifacts import load_artifact
    from torchcls.artifacts.exporter import OnDevice
    from torchcls.artifacts.parity import held_out_images, measure_parity
    from torchcls.checkpoint.files import load_model
    from torchcls.provenance.digest import sha256_file
    from torchcls.provenance.trust import record_export

    device, path = _device(args.device), Path(args.artifact)
    phase("parity:images")
    model, meta = load_model(args.checkpoint)
    images, labels = held_out_images(meta, args.images)
    phase("parity:load")
    artifact = load_artifact(path, device=args.device, trust=True)
    phase("parity:run")
    reference = model if device.type == "cpu" else OnDevice(model, device)
    result = measure_parity(reference, artifact, images, labels, args.min_agreement)
    result.update(artifact=path.name, device=device.type, diagnosed_in="separate processes (aoti_diag.py)")
    (path.parent / "parity.json").write_text(json.dumps(result, indent=2))
    rec.set(parity=result)
    if result["passed"]:
        record_export(path, sha256_file(path))
    return 0 if result["passed"] else 1


def backtrace(args, rec: Record) -> int:
    """`load --via aoti` under cuda-gdb (the device image has no gdb; cuda-gdb debugs host code too): the
    native backtrace of a crash that faulthandler can only place at a Python line."""
    gdb = shutil.which("cuda-gdb") or next((g for g in ("/usr/local/cuda/bin/cuda-gdb",) if Path(g).exists()), None)
    if gdb is None:
        rec.set(error="cuda-gdb not found")
        return 1
    inner = Path(args.json).with_name("aoti_load_under_gdb.json")
    cmd = [gdb, "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40", "-ex", "info sharedlibrary",
           "--args", sys.executable, __file__, "load", "--artifact", args.artifact, "--via", "aoti", "--device",
           args.device, "--json", str(inner)]
    phase("backtrace:cuda-gdb")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.gdb_timeout)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text, code = f"{e.stdout or ''}{e.stderr or ''}\n(cuda-gdb timed out)", None
    rec.set(command=" ".join(cmd), returncode=code, signal_seen=[s for s in ("SIGSEGV", "SIGABRT", "SIGBUS")
                                                                 if s in text], output_tail=text[-20000:])
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("preflight", "smoke", "compile", "load", "parity", "backtrace", "run-package"))
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--device", default="cuda")
    p.add_argument("--checkpoint", help="compile, parity: a torchcls run dir or .safetensors")
    p.add_argument("--artifact", help="the .pt2 to write (compile) or read")
    p.add_argument("--sources", default=".", help="smoke, compile: where packages and aoti_sources.tar.gz go")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--no-freeze", action="store_true", help="compile without Inductor's freezing")
    p.add_argument("--via", choices=("aoti", "torchcls"), default="aoti", help="load: which loader")
    p.add_argument("--images", type=int, default=256, help="parity: held-out images")
    p.add_argument("--min-agreement", type=float, default=0.99)
    p.add_argument("--gdb-timeout", type=float, default=40)
    args = p.parse_args()
    rec = Record(args.json) if args.json else None
    commands = {"preflight": preflight, "smoke": smoke, "compile": compile_package, "load": load, "parity": parity,
                "backtrace": backtrace, "run-package": run_package}
    return commands[args.command](args, rec)


if __name__ == "__main__":
    sys.exit(main())
