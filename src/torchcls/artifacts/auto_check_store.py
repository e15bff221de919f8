"""Where --precision auto's eager check is remembered: one small JSON record per (checkpoint content,
candidate precision, machine), so that predict and serve of a checkpoint pay the 200-image check once.

A record is data, never code: the top-1 agreement it measured and the number of images, under a key
that names the weights and the machine. What it may change is only whether the precision the rule
picked (bf16) runs or fp32 does; the bound it is held to is read at use (parity.DEFAULT_MIN_AGREEMENT).

The records live in the user's own cache folder ($TORCHCLS_CACHE_DIR, else $XDG_CACHE_HOME/torchcls,
else ~/.cache/torchcls; sub-folder precision-checks/), never in the run dir: a run dir is as often one
a user was sent (run_files.py), and a forged "bf16 agrees 100%" there would run a checkpoint in bf16
where bf16 disagrees with fp32 — predictions other than those the fp32 evaluation vouched for, and
nothing cheaper than the check itself could tell. So the folder is used only while it is a directory
of this user's with no group or other write permission, and it is opened once and held: the ownership
checked and every read and write after it concern that very directory, whatever is renamed meanwhile.
A record read back is bounded (RECORD_BOUNDS) and checked field by field; anything else about it (a
link, damage, another key, a value outside its range) means the check runs again and replaces it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.run_files import read_bytes, write_text_atomic

FORMAT = "torchcls-auto-precision-check/1"
CACHE_ENV = "TORCHCLS_CACHE_DIR"  # the same folder as the training step's timed choice (training/step_choice.py)
FOLDER = "precision-checks"
RECORD_BOUNDS = JsonBounds(max_bytes=4096, max_values=64, max_depth=3, max_str=256)
MAX_RECORDS = 512  # records kept; the oldest beyond this are removed when one is written
_NAME = re.compile(r"[0-9a-f]{64}\.json")


@dataclass(frozen=True)
class Measured:
    """What one check measured: top-1 agreement of the reduced precision with fp32 on `n` held-out images."""

    top1_agreement: float
    n: int


def weights_digest(model: nn.Module, meta_json: str) -> str:
    """SHA-256 of what runs: the checkpoint's metadata (model, config, preprocessing) and every tensor of the
    model as loaded (name, dtype, shape, bytes), so a decision belongs to exactly these weights whatever
    happens to the file meanwhile."""
    h = hashlib.sha256(meta_json.encode())
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"\0{name}\0{flat.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(flat.view(torch.uint8).numpy().data)  # the raw bytes, without a copy
    return h.hexdigest()


def machine_key(device: torch.device) -> dict[str, str]:
    """What a reduced precision's numbers depend on here: torch, the device and, on a CPU, the kernels torch
    and oneDNN use (capability, bf16 units, an ISA cap) and the thread count (it splits reductions)."""
    key = {"torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return key | {"gpu": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}",
                      "cuda": str(torch.version.cuda)}
    from torchcls.machine import cpu_flags
    from torchcls.precision.hardware import NATIVE_BF16_FLAGS

    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return key | {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "onednn_max_isa": isa[:64],
                  "bf16_units": ",".join(sorted(set(cpu_flags()) & set(NATIVE_BF16_FLAGS))),
                  "threads": str(torch.get_num_threads())}


def cache_folder() -> Path:
    base = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchcls"
    return Path(base) / FOLDER


def record_name(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".json"


@contextlib.contextmanager
def private_folder(create: bool) -> Iterator[tuple[Path, int]]:
    """The cache folder, held open: (a path that names that very directory, its descriptor). UserError when
    it is missing (create=False), a link, not this user's, or writable by others."""
    folder = cache_folder()
    if create:
        with contextlib.suppress(OSError):  # (refused below, by name, if it still is not there)
            folder.parent.parent.mkdir(parents=True, exist_ok=True)
            for d in (folder.parent, folder):
                d.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UserError(f"{folder}: no usable cache folder ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UserError(f"{folder}: not used as the precision-check cache: it must be a folder of this user's "
                            f"that no one else may write (it is mode {stat.S_IMODE(st.st_mode):o}, owner "
                            f"{st.st_uid}); chmod 700 it, or set {CACHE_ENV} to one")
        # /proc/self/fd/N/name resolves inside the directory held open, not whatever `folder` names later.
        anchor = Path(f"/proc/self/fd/{fd}")
        yield (anchor if anchor.is_dir() else folder), fd
    finally:
        os.close(fd)


def recall(key: dict[str, str]) -> tuple[Measured | None, str]:
    """The measurement remembered under `key` (None and why not when there is none to use)."""
    if not os.path.lexists(cache_folder()):
        return None, "not checked before on this machine"
    try:
        with private_folder(create=False) as (folder, _):
            path = folder / record_name(key)
            if not os.path.lexists(path):
                return None, "not checked before on this machine"
            data = read_bytes(path, max_bytes=RECORD_BOUNDS.max_bytes, what="precision-check record")
            return _checked(load_bounded(data, RECORD_BOUNDS, "precision-check record"), key), ""
    except (UserError, OSError) as e:
        return None, f"cached record not used: {str(e)[:300]}"


def _checked(record: object, key: dict[str, str]) -> Measured:
    from torchcls.artifacts.parity import AUTO_CHECK_IMAGES

    if not isinstance(record, dict) or set(record) != {"format", "key", "top1_agreement", "n"}:
        raise UserError("not a precision-check record (its keys differ)")
    if record["format"] != FORMAT or record["key"] != key:  # (its file name is a hash of the key: a copy or forgery)
        raise UserError("a record of another format, checkpoint, precision or machine")
    agreement, n = record["top1_agreement"], record["n"]
    if type(agreement) not in (int, float) or not 0.0 <= agreement <= 1.0:
        raise UserError(f"top1_agreement {str(agreement)[:40]} is not a fraction")
    if type(n) is not int or not 1 <= n <= AUTO_CHECK_IMAGES:
        raise UserError(f"n {str(n)[:40]} is not between 1 and {AUTO_CHECK_IMAGES}")
    return Measured(float(agreement), n)


def remember(key: dict[str, str], measured: Measured) -> str:
    """Write the record (replacing the name, never through a link); returns where, or why it was not kept."""
    record = {"format": FORMAT, "key": key, "top1_agreement": measured.top1_agreement, "n": measured.n}
    try:
        with private_folder(create=True) as (folder, fd):
            write_text_atomic(folder / record_name(key), json.dumps(record, indent=1, sort_keys=True), private=True)
            _prune(fd)
    except (UserError, OSError) as e:  # (a read-only home: the decision stands, unremembered)
        return f"not remembered: {str(e)[:300]}"
    return f"remembered in {cache_folder() / record_name(key)}"


def _prune(fd: int) -> None:
    """Keep the newest MAX_RECORDS records (only names this module writes are touched)."""
    names = [n for n in os.listdir(fd) if _NAME.fullmatch(n)]
    if len(names) <= MAX_RECORDS:
        return
    def age(name: str) -> int:
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime_ns
        except OSError:  # (removed meanwhile by another process's prune)
            return 0

    for name in sorted(names, key=age)[:len(names) - MAX_RECORDS]:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=fd)
