"""Hooks from installed packages: the entry-point group `torchcls.hooks`, chosen by name.

Each test makes a real (fake) installed distribution in a temporary folder: a module and a
`NAME-0.1.dist-info/` with METADATA and entry_points.txt, found through sys.path like any
installed package. Only the entry point whose name is asked for is ever loaded, and only after
every name asked for was found; what it loads must be the hook registered under that name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from torchcls.errors import UserError
from torchcls.governance import hooks as hooks_mod
from torchcls.governance.hooks import available_hooks, resolve_hooks

HOOK_SRC = """import os
from pathlib import Path
from torchcls.governance import hook
Path(os.environ["TORCHCLS_TEST_MARKER"]).write_text("{module} was imported")

@hook("{name}", "model")
def blur(model):
    Path(os.environ["TORCHCLS_TEST_MARKER"]).write_text(type(model).__name__)
    return model
"""
TRAP_SRC = """from pathlib import Path
Path({marker!r}).write_text("imported")  # must never happen: nobody asked for this entry point
"""


def install(root: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str]) -> Path:
    """A distribution `dist` 0.1 installed in `root` (a sys.path folder), as pip would lay it out."""
    root.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[torchcls.hooks]\n" + "".join(f"{k} = {v}\n" for k, v in
                                                                           entry_points.items()))
    return root


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh sys.path folder for fake installed packages, a private hook registry, and the modules
    the test imports forgotten afterwards. Module names carry a random suffix (`mod("x")`)."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(hooks_mod, "REGISTRY", dict(hooks_mod.REGISTRY))
    monkeypatch.setenv("TORCHCLS_TEST_MARKER", str(tmp_path / "imported"))
    suffix = uuid.uuid4().hex[:8]
    before = set(sys.modules)
    yield root, (lambda name: f"{name}_{suffix}")
    for name in set(sys.modules) - before:
        if name.endswith(suffix):
            del sys.modules[name]


def test_an_installed_entry_point_hook_runs_in_a_cli_training_run(shapes_dir, tmp_path):
    root = install(tmp_path / "site", "mypkg", {"mypkg": HOOK_SRC.format(module="mypkg", name="blur")},
                   {"blur": "mypkg:blur"})
    marker = tmp_path / "marker"
    env = os.environ | {"PYTHONPATH": str(root), "TORCHCLS_TEST_MARKER": str(marker)}
    proc = subprocess.run([sys.executable, "-m", "torchcls", "train", "--data", str(shapes_dir), "--epochs", "1",
                           "--workers", "0", "--batch-size", "8", "--img-size", "32", "--precision", "fp32",
                           "--no-channels-last", "--threads", "2", "--no-progress", "--out-dir",
                           str(tmp_path / "runs"), "--name", "ep", "--hooks", "blur"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.read_text() == "SmallNet"  # the hook got the model
    assert json.loads((tmp_path / "runs" / "ep" / "governance.json").read_text())["hooks"] == ["blur"]


def test_an_entry_point_that_is_not_a_hook_is_refused(site):
    root, mod = site
    install(root, "plain", {mod("plain"): "def blur(model):\n    return model\n"}, {"plainhook": f"{mod('plain')}:blur"})
    with pytest.raises(UserError, match="entry point 'plainhook' .*plain 0.1.* is not a registered hook"):
        resolve_hooks("plainhook")


def test_an_entry_point_registered_under_another_name_is_refused(site):
    root, mod = site
    install(root, "renamed", {mod("renamed"): HOOK_SRC.format(module="renamed", name="other-name")},
            {"blur-faces": f"{mod('renamed')}:blur"})
    with pytest.raises(UserError, match="entry point 'blur-faces' .* is registered as 'other-name'"):
        resolve_hooks("blur-faces")


def test_an_unknown_name_loads_no_entry_point(site, tmp_path):
    """Neither an unknown name nor a known one loads an entry point that was not asked for, and a
    known entry point is not loaded when another name of the same list is unknown."""
    root, mod = site
    trap = tmp_path / "trap-imported"
    install(root, "trap", {mod("trap"): TRAP_SRC.format(marker=str(trap))}, {"trap": f"{mod('trap')}:h"})
    install(root, "good", {mod("good"): HOOK_SRC.format(module="good", name="good")}, {"good": f"{mod('good')}:blur"})
    with pytest.raises(UserError, match="unknown hook.*'nosuch'.*available: (.*, )?good, (.*, )?redact-samples, strip-exif, trap"):
        resolve_hooks("good,nosuch")
    assert [h.name for h in resolve_hooks("strip-exif")] == ["strip-exif"]
    assert "trap" in available_hooks()  # listed from metadata ...
    assert not trap.exists() and mod("trap") not in sys.modules  # ... never imported
    assert not Path(os.environ["TORCHCLS_TEST_MARKER"]).exists() and mod("good") not in sys.modules
    assert [h.name for h in resolve_hooks("good")] == ["good"]  # asked for: loaded
    assert mod("good") in sys.modules and mod("trap") not in sys.modules


def test_an_entry_point_cannot_take_a_builtin_name(site):
    root, mod = site
    install(root, "shadow", {mod("shadow"): HOOK_SRC.format(module="shadow", name="strip-exif")},
            {"strip-exif": f"{mod('shadow')}:blur", "shadow": f"{mod('shadow')}:blur"})
    builtin = hooks_mod.REGISTRY["strip-exif"]
    assert resolve_hooks("strip-exif") == [builtin] and mod("shadow") not in sys.modules  # the built-in wins
    with pytest.raises(UserError, match="'shadow' .*failed to load: ValueError: hook name 'strip-exif' is already"):
        resolve_hooks("shadow")  # its module tries to re-register strip-exif: refused
    assert hooks_mod.REGISTRY["strip-exif"] is builtin


def test_a_name_two_packages_declare_is_refused(site):
    root, mod = site
    for dist in ("one", "two"):
        install(root, dist, {mod(dist): HOOK_SRC.format(module=dist, name="twice")}, {"twice": f"{mod(dist)}:blur"})
    with pytest.raises(UserError, match="'twice' is declared by several installed packages"):
        resolve_hooks("twice")
    assert mod("one") not in sys.modules and mod("two") not in sys.modules


def test_an_entry_point_that_fails_to_import_names_its_package(site):
    root, mod = site
    install(root, "broken", {mod("broken"): "raise RuntimeError('no GPU here')\n"}, {"broken": f"{mod('broken')}:h"})
    with pytest.raises(UserError, match=r"'broken' \(.*broken 0.1\) failed to load: RuntimeError: no GPU here"):
        resolve_hooks("broken")


def test_more_hooks_than_a_run_record_holds_are_refused_before_training():
    """RunRecord holds at most MAX_RUN_HOOKS names: a run given more would train and then lose its audit record (the
    writer refuses it), so --hooks refuses them first."""
    from torchcls.provenance.records import MAX_RUN_HOOKS

    too_many = rf"--hooks .*: {MAX_RUN_HOOKS + 1} hooks; a run records at most {MAX_RUN_HOOKS}"
    with pytest.raises(UserError, match=too_many):
        hooks_mod.resolve_hooks(",".join(["strip-exif"] * (MAX_RUN_HOOKS + 1)))
    assert len(hooks_mod.resolve_hooks(",".join(["strip-exif"] * MAX_RUN_HOOKS))) == MAX_RUN_HOOKS
