"""`torchcls audit kernels` on a real custom-op package (tests/kernels_example) and a real CUDA extension."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # makes tests/kernels_example importable, as --import would


@pytest.fixture(scope="module")
def audit():
    from torchcls.kernel_audit.kernels import audit_kernels

    return audit_kernels(["kernels_example"], model="kernels_example:gelu_net",
                         namespaces=["torchcls_example"]).as_dict()


def _op(audit, name):
    return next(op for op in audit["ops"] if op["name"] == f"torchcls_example::{name}")


def test_broken_fake_impl_is_flagged_and_good_op_passes(audit):
    bad, good = _op(audit, "row_sum"), _op(audit, "scaled_gelu")
    assert good["status"] == "pass" and good["traceable"]
    assert {c["name"]: c["status"] for c in good["checks"]} == {
        "cpu_kernel": "pass", "cuda_kernel": "pass", "fake_impl": "pass", "autograd": "pass", "opcheck": "pass"}
    assert "2 sample(s)" in good["checks"][-1]["detail"]
    assert bad["status"] == "fail" and not bad["traceable"]
    opcheck = next(c for c in bad["checks"] if c["name"] == "opcheck")
    assert opcheck["status"] == "fail" and "test_faketensor" in opcheck["detail"]
    assert "fake impl" in opcheck["fix"]
    assert "Meta" in bad["dispatch_keys"] and "Autograd" in bad["dispatch_keys"]
    assert audit["passed"] is False and audit["failures"] == ["torchcls_example::row_sum: opcheck"]


def test_model_graph_and_triton_kernels_found(audit):
    assert audit["model"]["exported"] and audit["model"]["custom_ops"] == {"torchcls_example::scaled_gelu": 2}
    assert [k["name"] for k in audit["triton_kernels"]] == ["add_kernel"]
    assert audit["triton_kernels"][0]["check"]["status"] == "skip"  # no GPU on the test machine


def test_op_without_fake_impl_fails_fake_check():
    import torch

    from torchcls.kernel_audit.ops import audit_op

    lib = torch.library.Library("torchcls_nofake", "DEF")
    lib.define("plus_one(Tensor x) -> Tensor")
    lib.impl("plus_one", lambda x: x + 1, "CPU")
    report = audit_op("torchcls_nofake::plus_one")
    checks = {c.name: c.status for c in report.checks}
    assert report.dispatch_keys == ["CPU"] and not report.traceable
    assert checks["fake_impl"] == "fail" and checks["cuda_kernel"] == "warn" and checks["autograd"] == "warn"
    assert checks["opcheck"] == "warn"  # generated sample only: the op is flagged but not blamed on the sample


def test_fatbin_archs_of_a_real_cuda_extension():
    import torchvision

    from torchcls.kernel_audit.binaries import runs_on, scan_shared_object

    so = Path(torchvision.__file__).parent / "_C_stable.so"
    if not so.is_file():
        pytest.skip("this torchvision build has no _C_stable.so")
    found = scan_shared_object(so)
    import torch

    # the extension is built for the same architectures as torch itself
    assert [f"sm_{a}" for a in found.cubin_archs] == [a for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    assert runs_on(found, (9, 0))[0] and not runs_on(found, (6, 1))[0]
    assert scan_shared_object(Path(torchvision.__file__).parent / "image_stable.so") is None


def test_cli_exit_codes(tmp_path):
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}
    cmd = [sys.executable, "-m", "torchcls", "audit", "kernels", "--import", "kernels_example", "--out", str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "| torchcls_example::row_sum |" in r.stdout and "What to fix" in r.stdout
    saved = json.loads((tmp_path / "kernel_audit.json").read_text())
    assert {op["name"] for op in saved["ops"]} == {"torchcls_example::row_sum", "torchcls_example::scaled_gelu"}
    r = subprocess.run(cmd[:4] + ["--import", "no_such_pkg_xyz"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no_such_pkg_xyz" in r.stderr and "Traceback" not in r.stderr
