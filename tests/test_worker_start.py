"""DataLoader workers start by fork in a single process and from a forkserver under torch.distributed
(data/worker_start.py): a fork there copies gloo's threads' locks as they happen to be."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import make_image_folder
from torchcls.data.worker_start import FORKSERVER_SUFFIX, SOCKET_PATH_MAX, check_socket_room
from torchcls.errors import UserError

SCRIPT = """
import os, sys, tempfile
import torch, torch.distributed as dist
from torchcls.config import DataConfig
from torchcls.data.loaders import build_data, make_loader
from torchcls.data.worker_start import worker_context

assert worker_context(1) is None  # one process, no group: fork, the platform's default
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
assert worker_context(0) is None  # no workers: nothing starts
cfg = DataConfig(source=sys.argv[1], img_size=32, augment="standard", val_fraction=0.25, workers=1)
data = build_data(cfg, seed=0)
loader = make_loader(data.train, 8, 1, shuffle=True)
assert loader.multiprocessing_context.get_start_method() == "forkserver"
seen = sum(len(y) for _, y in loader)
assert seen == len(data.train), (seen, len(data.train))
print("ok", seen)
"""


def _tmpdir_of_length(n: int) -> str:
    """A fresh folder whose path is exactly n bytes long."""
    base = tempfile.mkdtemp(prefix="w")
    path = os.path.join(base, "x" * (n - len(base) - 1))
    os.mkdir(path)
    assert len(path) == n
    return path


def test_workers_start_from_a_forkserver_under_torch_distributed(tmp_path: Path) -> None:
    """... with TMPDIR as long as the forkserver's socket allows: the bound below refuses nothing that works."""
    folder = make_image_folder(tmp_path / "shapes", per_class=8)
    tmp = _tmpdir_of_length(SOCKET_PATH_MAX - FORKSERVER_SUFFIX)
    try:
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, TMPDIR=tmp))
    finally:
        shutil.rmtree(os.path.dirname(tmp))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok", "12"]


def test_a_tmpdir_too_long_for_the_forkserver_socket_is_named_with_the_fix(monkeypatch) -> None:
    tmp = _tmpdir_of_length(SOCKET_PATH_MAX - FORKSERVER_SUFFIX + 1)
    try:
        monkeypatch.setattr(tempfile, "tempdir", tmp)
        with pytest.raises(UserError, match=f"{tmp} is too long .* set TMPDIR to a shorter folder"):
            check_socket_room()
        monkeypatch.setattr(tempfile, "tempdir", os.path.dirname(tmp))
        check_socket_room()
    finally:
        shutil.rmtree(os.path.dirname(tmp))
