"""How DataLoader worker processes start: forked from the training process where that is safe, from a
forkserver where it is not.

fork copies the calling thread only, and with it every lock as it was at that instant. A lock that another
thread of the training process held then stays held in the worker for ever, and the worker hangs on its first
use of it (pytorch/pytorch#130610: a thread inside torch.set_num_threads held the atexit lock). A single
process has no such threads of its own (PyTorch resets its OpenMP pool in a forked child), so fork, the
cheapest start, stays its default. Under torch.distributed the process runs gloo's and the store's threads,
which work between steps (gradient all-reduces, buffer broadcasts), and a shard loader forks new workers every
epoch there. A test run of two ranks over shards hung in 2 of about 6 full test suites (one rank never reached
its next step, the other timed out in DDP's buffer broadcast), never in 30 runs alone; the hang was not caught
in the act, and a fork in a multi-threaded process is the suspect of that shape on this path. So there the
workers start from a forkserver: a separate single-threaded process (it imports torch once, in parallel with the run) that forks
each worker; the dataset reaches the worker pickled, as under spawn.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from multiprocessing.context import BaseContext

import torch

from torchcls.errors import UserError

# Imported once by the forkserver, so each worker it forks starts with them (what a worker unpickles needs).
PRELOAD = ["torch", "torchvision.transforms.v2", "torchcls.data.loaders", "torchcls.data.streaming"]


def has_service_threads() -> bool:
    """Does this process run threads of its own that fork would copy mid-work (torch.distributed's)?"""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def worker_context(workers: int) -> BaseContext | None:
    """The `multiprocessing_context` of a DataLoader with `workers` processes (None: the platform's default)."""
    if workers <= 0 or not has_service_threads() or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    check_socket_room()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # (replaces the default ['__main__']: the CLI is never re-imported)
    return context


# A Unix socket's path holds at most 107 bytes (sun_path is 108, NUL included).
SOCKET_PATH_MAX = 107
# The forkserver listens on TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (multiprocessing's temp folder, then a
# random name in it): 32 bytes beyond TMPDIR.
FORKSERVER_SUFFIX = len("/pymp-12345678/listener-12345678")


def check_socket_room() -> None:
    """A clear error, before any worker starts, where TMPDIR is too long for the forkserver's socket: Python
    (3.10-3.13) fails there with a bare `OSError: AF_UNIX path too long` from inside the first worker's start."""
    tmp = tempfile.gettempdir()
    length = len(os.fsencode(tmp)) + FORKSERVER_SUFFIX
    if length > SOCKET_PATH_MAX:
        raise UserError(f"the temporary folder {tmp} is too long for the socket through which loader workers start "
                        f"under torch.distributed ({length} bytes with the forkserver's names; a Unix socket's path "
                        f"holds {SOCKET_PATH_MAX}): set TMPDIR to a shorter folder (such as /tmp), or use --workers 0")
