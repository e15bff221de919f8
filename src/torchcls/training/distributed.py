"""Multi-process training under torchrun: process group, rank-0 duties, timeouts, elastic restarts.

torchrun (PyTorch's own launcher) starts one process per device and sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT and TORCHELASTIC_RESTART_COUNT; we never launch processes
ourselves. `Session` is what the training loop talks to: for `--parallel none` it is an
inactive session (rank 0 of 1) whose helpers fall back to the single-process behaviour.

Whether a start is a restart is decided for the whole job, never from this node's
TORCHELASTIC_RESTART_COUNT alone: torchrun's agent counts only the failures of its own
workers, and restarts healthy ones without counting when another node's agent re-joins the
rendezvous ("membership changes do not count as retries", torch/distributed/elastic/agent/
server/api.py). So after one node's worker died, its ranks started with a count of 1 and the
other node's with 0: one waited in the restart's barrier while the other refused the existing
run dir in a broadcast, until the gloo timeout ended the job.

Testing aid (fault injection): TORCHCLS_FAULT_STEP=k makes rank TORCHCLS_FAULT_RANK
(default 1) kill itself with SIGKILL right after optimizer step k, on the job's first start
only, so that `torchrun --max-restarts 1` restarts the job and it resumes from the last
checkpoint. Never set it outside tests.
"""

from __future__ import annotations

import datetime
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchcls.checkpoint.checkpointer import Checkpointer
from torchcls.checkpoint.files import CHECKPOINTS
from torchcls.config import Config
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.made_dirs import identity, move_aside
from torchcls.training.rundir import CREATED_BY, RunDir, created_by, default_name, job_id

FAULT_STEP_ENV, FAULT_RANK_ENV = "TORCHCLS_FAULT_STEP", "TORCHCLS_FAULT_RANK"
UNIDENTIFIED = "unidentified/"  # a job that nothing tells apart from another (job_of)


class FollowerRunDir(RunDir):
    """The run dir as seen by ranks other than 0: they read it but never write logs."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def truncate_metrics(self, after_step: int) -> None:
        pass


@dataclass
class Session:
    active: bool = False  # a process group exists (ddp/fsdp2 under torchrun)
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    restart_count: int = 0  # the job's: the most restarts any node's torchrun agent counted
    parallel: str = "none"
    generation: int = 1  # which start of the job this is, where the job's store outlives its starts
    job: str = field(default_factory=job_id)  # this torchrun job, as recorded in the run dirs it creates
    # Rank 0: torchrun's agent store, where it outlives the starts of the job (None otherwise). It keeps the
    # proof that a start of this job created a run dir: the dir's own files could be written by anyone.
    job_store: dist.Store | None = field(default=None, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def restarted(self) -> bool:
        """An earlier start of this job ran: torchrun restarted the workers (some node counted a
        failure, or a node re-joined, which no agent counts) or the store has seen a start before."""
        return self.restart_count > 0 or self.generation > 1

    # -- rank-0 helpers ---------------------------------------------------------------
    def prepare_run(self, cfg: Config) -> RunDir:
        """Rank 0 creates (or checks) the run dir; the others get its path or the same error."""
        if not self.active:
            return RunDir.prepare(cfg)
        outcome: list[Any] = [None]
        run = None
        if self.is_main:
            try:
                run = RunDir.prepare(cfg, self.job)
                if run.made is not None and self.job_store is not None:
                    self.job_store.set(_made_key(run.path), identity(run.path))
                outcome[0] = ("ok", str(run.path), cfg.run.name)
            except UserError as e:
                outcome[0] = ("error", str(e), None)
        dist.broadcast_object_list(outcome, src=0)
        kind, value, name = outcome[0]
        if kind == "error":
            raise UserError(value)
        cfg.run.name = name
        return run if run is not None else FollowerRunDir(Path(value), self.job)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    # -- reductions: every rank reports the same numbers ------------------------------------
    def mean(self, value: torch.Tensor | float) -> float:
        value = float(value.detach() if torch.is_tensor(value) else value)
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / self.world

    def sum(self, values: list[float]) -> list[float]:
        """Each value added up over the ranks (float64)."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    # -- elastic ---------------------------------------------------------------------------
    def callbacks(self) -> list[Callable[[int], None]]:
        step = os.environ.get(FAULT_STEP_ENV)
        if not step or not self.active or self.restarted:
            return []
        fault_step, fault_rank = int(step), int(os.environ.get(FAULT_RANK_ENV, "1"))

        def fault(global_step: int) -> None:
            if global_step == fault_step and self.rank == fault_rank:
                print(f"torchcls: {FAULT_STEP_ENV}={fault_step}: rank {self.rank} kills itself (testing aid)",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        return [fault]

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup(cfg: Config) -> Session:
    """Join the process group torchrun prepared (or return an inactive session), and decide
    whether this is an elastic restart that must resume."""
    tc = cfg.parallel
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    if tc.parallel == "none":
        if world > 1:
            raise UserError(f"started with {world} processes (torchrun) but --parallel none: pass --parallel ddp "
                            "or --parallel fsdp2, otherwise every process would train its own copy")
        return Session()
    if not launched_by_torchrun():
        raise UserError(f"--parallel {tc.parallel} needs processes started by torchrun, e.g. `torchrun "
                        f"--nproc-per-node 2 -m torchcls train ... --parallel {tc.parallel}` (one process: "
                        "--nproc-per-node 1); for a single process without torchrun use --parallel none")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise UserError(f"missing rendezvous endpoint: {' and '.join(missing)} not set. Start through torchrun "
                        "(--standalone on one machine, --rdzv-endpoint HOST:PORT on several)")
    if cfg.data.batch_size % world:
        raise UserError(f"--batch-size {cfg.data.batch_size} is the global batch and must be divisible by the "
                        f"world size {world}: choose a multiple of {world}")
    if tc.sync_bn and not torch.cuda.is_available():
        raise UserError("--sync-bn needs CUDA (PyTorch's SyncBatchNorm runs on GPUs only); on CPU, BatchNorm "
                        "running statistics are averaged across ranks before eval and save instead")
    if tc.fsdp_cpu_offload and (tc.parallel != "fsdp2" or not torch.cuda.is_available()):
        raise UserError("--fsdp-cpu-offload keeps FSDP2 shards in host memory while computing on a GPU: it needs "
                        "--parallel fsdp2 and CUDA (here parameters already live in host memory)")
    session = Session(True, int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")),
                      int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), tc.parallel)
    token = _init_process_group(session, cfg.train.device, tc.dist_timeout)
    if not session.is_main:
        console.quiet = True  # only rank 0 prints (and writes) anything; errors still go to stderr
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    _agree_on_start(session, cfg, token)
    if session.restarted:
        _prepare_restart(session, cfg)
    return session


def _init_process_group(s: Session, device: str, timeout_s: int) -> str | None:
    """Join the process group under this start's generation (sets s.generation); returns rank 0's
    job token (None on the other ranks, or where the store does not outlive the start)."""
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if use_cuda:
        # One GPU per process: plain "cuda" then means this rank's GPU everywhere in the loop.
        torch.cuda.set_device(s.local_rank)
    # NCCL for GPU tensors, gloo for CPU ones (and for the objects rank 0 broadcasts).
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        s.generation, prefixed = _generation_store(store, s.rank, s.world, timeout_s)
        dist.init_process_group(backend, store=prefixed, rank=s.rank, world_size=s.world, timeout=timeout)
        if not s.is_main:
            return None
        token = _job_token(store)
        s.job_store = store if token is not None else None
        return token
    except (RuntimeError, ValueError, TimeoutError) as e:
        raise UserError(f"rank {s.rank} could not join the process group at {addr} within {timeout_s}s "
                        f"({str(e).splitlines()[0]}): check that the rendezvous endpoint is reachable and all "
                        f"{s.world} processes were started; --dist-timeout changes the wait") from None


def _generation_store(store: dist.Store, rank: int, world: int, timeout_s: float) -> tuple[int, dist.Store]:
    """Give every start of the job its own key space in the rendezvous store.

    torchrun's agent keeps one TCPStore for the whole job (TORCHELASTIC_USE_AGENT_STORE), so
    after an elastic restart the previous attempt's keys are still there: gloo could read a dead
    peer's address and fail with "Connection refused" (pytorch/pytorch#135712). Every rank of one
    start must pick the same fresh prefix. Neither a count of ranks started (a rank that dies
    before adding itself shifts every later start) nor TORCHELASTIC_RESTART_COUNT (each node's
    agent counts its own restarts: a node restarted because another node failed does not count
    one) can promise that. So rank 0 draws the generation and hands it to each rank in answer to
    a nonce that rank made up for this start: an answer meant for a rank of an earlier start can
    never be taken for this one. Every rank of an earlier start is gone before a new one begins.
    Returns the generation (1: the store's first start) and the store under its prefix.
    """
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        generation = store.add("torchcls/generation", 1)
        _answer_ranks(store, generation, world, deadline)
    else:
        nonce = secrets.token_hex(16)
        store.set(f"torchcls/hello/{rank}", nonce)
        store.wait([f"torchcls/welcome/{nonce}"], datetime.timedelta(seconds=timeout_s))
        generation = int(store.get(f"torchcls/welcome/{nonce}"))
        store.set(f"torchcls/generation_{generation}/joined/{rank}", b"1")
    return generation, dist.PrefixStore(f"torchcls/generation_{generation}", store)


def _job_token(store: dist.Store) -> str | None:
    """Rank 0: a token drawn by the job's first start and read back by every later one, where the
    store is torchrun's agent store (it lives as long as the job). TORCHELASTIC_RUN_ID alone does not
    tell jobs apart: it is "none" for every multi-node job started without --rdzv-id, so a restart
    could take a run dir an earlier job made for its own. Where rank 0 hosts a store of its own
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) nothing outlives a start: None, and the run id is the job,
    unless it is "none" (job_of)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    return store.compare_set("torchcls/job", "", secrets.token_hex(16)).decode()


def _answer_ranks(store: dist.Store, generation: int, world: int, deadline: float) -> None:
    """Rank 0: tell each rank's latest nonce the generation until every rank confirmed it. A nonce
    left by an earlier start is answered too (harmlessly) and later replaced by the rank's new one."""
    waiting, answered = set(range(1, world)), {}
    while waiting:
        for r in sorted(waiting):
            if store.check([f"torchcls/generation_{generation}/joined/{r}"]):
                waiting.discard(r)
            elif store.check([f"torchcls/hello/{r}"]):
                nonce = store.get(f"torchcls/hello/{r}").decode()
                if answered.get(r) != nonce:
                    store.set(f"torchcls/welcome/{nonce}", str(generation))
                    answered[r] = nonce
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(waiting)} did not join generation {generation} in time")
        if waiting:
            time.sleep(0.01)


def job_of(run_id: str | None, token: str | None, nonce: str) -> str | None:
    """The job as the run dirs it creates record it (None: not under torchrun). torchrun's run id is
    "none" for every job started without --rdzv-id; with no token to tell such jobs apart (no agent
    store: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the job is named after this start's `nonce`, so no
    other job can ever claim its run dir, and a restart of it resumes nothing (_restart_decision)."""
    if run_id and token:
        return f"{run_id}/{token}"
    if run_id and run_id != "none":
        return run_id
    return f"{UNIDENTIFIED}{nonce}" if run_id else None


def _agree_on_start(s: Session, cfg: Config, token: str | None) -> None:
    """What every rank must take alike, from one exchange: rank 0's run name (the default one contains
    the time), the job (run id and rank 0's token) and whether this start is a restart (the most
    restarts any node counted: see the module's docstring)."""
    named = cfg.run.name is not None
    views = s.gather_objects((s.restart_count, cfg.run.name or default_name(cfg), token, secrets.token_hex(8)))
    s.restart_count = max(v[0] for v in views)
    cfg.run.name, token = views[0][1], views[0][2]
    s.job = job_of(os.environ.get("TORCHELASTIC_RUN_ID"), token, views[0][3]) or s.job
    if s.restarted and not named:
        console.print("[yellow]elastic restart without --name: a new run dir is started; pass --name to "
                      "resume from the last checkpoint[/]")


def _prepare_restart(s: Session, cfg: Config) -> None:
    """torchrun restarted the ranks after one failed: resume this job's run dir from its last checkpoint.
    Rank 0 decides and every rank follows, so they all take the same collectives next."""
    path = Path(cfg.run.out_dir) / cfg.run.name
    if cfg.run.resume:  # the user's own --resume: it says which run to continue
        return
    decision = [_restart_decision(path, s.job, s.job_store) if s.is_main else None]
    dist.broadcast_object_list(decision, src=0)
    if decision[0] not in ("resume", "start"):  # every rank stops alike, with rank 0's reason
        raise UserError(decision[0])
    if decision[0] == "resume":
        cfg.run.resume = True
        restart = max(s.restart_count, s.generation - 1)  # (a re-join counts in the generation only)
        console.print(f"[yellow]elastic restart {restart}: resuming {path} from its last checkpoint[/]")


def _made_key(path: Path) -> str:
    return f"torchcls/made/{os.path.abspath(path)}"


def _restart_decision(path: Path, job: str, store: dist.Store | None = None) -> str:
    """Rank 0: "resume" a run dir this job started in and checkpointed, "start" when there is none, or the
    reason to stop. A dir another job (or the user) made is never resumed nor changed: the start then
    refuses it as it refused the first time. Nothing is ever removed: a dir with no checkpoint is moved
    aside only when the agent's store, which no file can write, holds that an earlier start of this job
    created this very dir (its device and inode); the marker inside names the job but proves nothing."""
    try:
        return _decide(path, job, store)
    except (UserError, OSError) as e:  # every rank must stop alike: rank 0's reason, not a hang in broadcast
        return f"elastic restart: {path}: {e}"


def _decide(path: Path, job: str, store: dist.Store | None) -> str:
    if not os.path.lexists(path):
        return "start"
    if job.startswith(UNIDENTIFIED):
        return (f"elastic restart: {path} exists and this torchrun job cannot tell whether it created it: its run id "
                'is "none" (no --rdzv-id) and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 nothing outlives a start, so '
                "any job started the same way looks alike. It is neither resumed nor changed: start torchrun with a "
                "--rdzv-id of this job's own to let a restart resume it, or continue it with --resume")
    if not created_by(path, job):
        console.print(f"[yellow]elastic restart: {path} was not created by this torchrun job; it is neither "
                      "resumed nor changed (pass --resume to continue a run explicitly)[/]")
        return "start"
    checkpointer = Checkpointer(path / CHECKPOINTS)
    checkpointer.recover()  # a crash between the two renames of a commit: before has_state looks
    if checkpointer.has_state():
        return "resume"
    key = _made_key(path)
    if store is None or not store.check([key]) or store.get(key).decode() != identity(path):
        return (f"elastic restart: {path} holds no checkpoint, and nothing but its own {CREATED_BY} (a file anyone "
                "who can write there could have written) says an earlier start of this job created it. It is left "
                "as it is: look inside, then remove or rename it and run the job again, or choose another --name")
    aside = move_aside(path, "failed-start")  # this job's, without a checkpoint: kept, out of the way
    console.print(f"[yellow]elastic restart: {path} was made by an earlier start of this job that saved no "
                  f"checkpoint: moved aside to {aside.name}, starting again[/]")
    return "start"


def sync_buffers(model: nn.Module, session: Session) -> None:
    """Average floating buffers (BatchNorm running stats) over ranks: FSDP leaves them per-rank."""
    if not session.active or session.world == 1:
        return
    for buf in model.buffers():
        if buf.is_floating_point():
            dist.all_reduce(buf, op=dist.ReduceOp.AVG if buf.is_cuda else dist.ReduceOp.SUM)
            if not buf.is_cuda:  # gloo has no AVG
                buf.div_(session.world)
