"""ExecuTorch edge benchmark: .pte size and batch-1 latency (fp32 and int8 XNNPACK programs) against
eager PyTorch and ONNX Runtime, measured in one process, interleaved (A B C D A B C D ...), medians;
plus the int8 accuracy drop of a briefly trained SmallNet on the Fashion-MNIST test set.

Models: resnet18 and mobilenetv3_large_100 (timm, random init: latency only) at 224 px, and the
built-in SmallNet at 28 px. Goal (issue 5): int8 ≥ 2.5× faster than the fp32 .pte at ≤ 0.5 pt drop.

    PYTHONPATH=src python benchmarks/edge.py [--quick]

Prints JSON, then a Markdown table. Never asserts on time; the machine may be shared (noisy).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from torchcls.machine import describe_machine, machine_line

FASHION = Path("/usr/share/datasets/fashion-mnist")
MEAN, STD = 0.2860, 0.3530


def fashion(split: str, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(FASHION / f"{prefix}-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(FASHION / f"{prefix}-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    x, y = x[:limit], y[:limit]
    return (torch.from_numpy(x.copy()).float() / 255 - MEAN) / STD, torch.from_numpy(y.astype(np.int64))


def train_smallnet(n_train: int, epochs: int) -> nn.Module:
    from torchcls.models.smallnet import SmallNet

    torch.manual_seed(0)
    x, y = fashion("train", n_train)
    model = SmallNet(10, 1)
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(128):
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def make_programs(model: nn.Module, example: torch.Tensor, calib: torch.Tensor, tmp: Path, name: str) -> dict:
    """fp32 and int8 .pte (XNNPACK) and an ONNX model, all from one batch-1 export."""
    import onnxruntime as ort
    from executorch.runtime import Runtime

    from torchcls.artifacts.quantize import quantize_int8
    from torchcls.artifacts.targets.executorch import lower

    with torch.no_grad():
        ep = torch.export.export(model, (example,))
    out: dict = {}
    for kind, prog_ep in (("fp32", ep), ("int8", None)):
        t = time.perf_counter()
        if kind == "int8":
            prog_ep = quantize_int8(ep, calib, None, batch=1)  # a batch-1 export: calibrate image by image
        data, report = lower(prog_ep, "xnnpack")
        path = tmp / f"{name}-{kind}.pte"
        path.write_bytes(data)
        out[kind] = {"method": Runtime.get().load_program(str(path)).load_method("forward"),
                     "bytes": len(data), "lower_s": time.perf_counter() - t,
                     "non_delegated": report.portable_ops}
    onnx_path = tmp / f"{name}.onnx"
    torch.onnx.export(ep, dynamo=True, optimize=True, verbose=False).save(str(onnx_path))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = torch.get_num_threads(), 1
    out["onnx"] = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    return out


def latency(model: nn.Module, progs: dict, x: torch.Tensor, rounds: int, reps: int) -> dict[str, float]:
    in_name = progs["onnx"].get_inputs()[0].name
    runners = {
        "eager": lambda: model(x),
        "onnxruntime": lambda: progs["onnx"].run(None, {in_name: x.numpy()}),
        "pte_fp32": lambda: progs["fp32"]["method"].execute([x]),
        "pte_int8": lambda: progs["int8"]["method"].execute([x]),
    }
    times: dict[str, list[float]] = {k: [] for k in runners}
    with torch.inference_mode():
        for f in runners.values():  # warm-up (XNNPACK packs weights on the first call)
            f(), f()
        for _ in range(rounds):
            for k, f in runners.items():
                t = time.perf_counter()
                for _ in range(reps):
                    f()
                times[k].append((time.perf_counter() - t) / reps * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def accuracy(method, x: torch.Tensor, y: torch.Tensor) -> float:
    correct = 0
    for i in range(len(x)):
        (logits,) = method.execute([x[i:i + 1]])
        correct += int(logits.argmax(1).item() == y[i].item())
    return correct / len(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, a smaller training/test subset, "
                    "mobilenetv3 and SmallNet only (no resnet18)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rounds, reps = (5, 3) if args.quick else (15, 10)
    n_train, epochs, n_test = (6_000, 1, 2_000) if args.quick else (60_000, 2, 10_000)
    import timm

    results = []
    calib28, _ = fashion("train", 256)
    # Calibration for the 224 px nets: real images (Fashion-MNIST upscaled to 3×224²), not noise.
    calib224 = nn.functional.interpolate(calib28[:64], size=224, mode="bilinear").repeat(1, 3, 1, 1)
    names = ["mobilenetv3_large_100"] + ([] if args.quick else ["resnet18"])
    with tempfile.TemporaryDirectory(prefix="torchcls-edge-") as tmp:
        tmp = Path(tmp)
        small = train_smallnet(n_train, epochs)
        models = [(n, timm.create_model(n, pretrained=False, num_classes=10).eval(), calib224) for n in names]
        models.append(("smallnet", small, calib28))
        for name, model, calib in models:
            x = calib[:1].clone()
            progs = make_programs(model, x, calib, tmp, name)
            lat = latency(model, progs, x, rounds, reps)
            row = {"model": name, "img_size": x.shape[-1], "pte_fp32_mb": progs["fp32"]["bytes"] / 1e6,
                   "pte_int8_mb": progs["int8"]["bytes"] / 1e6, "latency_ms_b1": lat,
                   "int8_speedup_vs_fp32_pte": lat["pte_fp32"] / lat["pte_int8"],
                   "non_delegated_int8": progs["int8"]["non_delegated"]}
            if name == "smallnet":
                xt, yt = fashion("test", n_test)
                with torch.no_grad():
                    eager_acc = (torch.cat([model(c) for c in xt.split(500)]).argmax(1) == yt).float().mean().item()
                row["fashion_mnist_test"] = {
                    "n": n_test, "eager_fp32": eager_acc, "pte_fp32": accuracy(progs["fp32"]["method"], xt, yt),
                    "pte_int8": accuracy(progs["int8"]["method"], xt, yt)}
                acc = row["fashion_mnist_test"]
                row["int8_drop_pt"] = 100 * (acc["pte_fp32"] - acc["pte_int8"])
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    machine = describe_machine("fp32 and int8 (.pte)")
    print(json.dumps({"quick": args.quick, "threads": torch.get_num_threads(), "rounds": rounds, "reps": reps,
                      "machine": machine, "results": results}, indent=2))
    print(f"\nMachine: {machine_line(machine)}")
    print("\n| model | px | .pte fp32 MB | .pte int8 MB | eager ms | ORT ms | .pte fp32 ms | .pte int8 ms "
          "| int8 vs fp32 .pte | int8 drop (pt) |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lat = r["latency_ms_b1"]
        drop = f"{r['int8_drop_pt']:.2f}" if "int8_drop_pt" in r else "n/a (random init)"
        print(f"| {r['model']} | {r['img_size']} | {r['pte_fp32_mb']:.2f} | {r['pte_int8_mb']:.2f} | "
              f"{lat['eager']:.2f} | {lat['onnxruntime']:.2f} | {lat['pte_fp32']:.2f} | {lat['pte_int8']:.2f} | "
              f"{r['int8_speedup_vs_fp32_pte']:.2f}× | {drop} |")


if __name__ == "__main__":
    main()
