"""The thread count re-chosen from the DataLoader workers' measured load (training/thread_tuning.py): the
decision from psutil-shaped readings, where it applies, and a run that records it and resumes with it."""

from __future__ import annotations

import json
import os

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import make_image_folder, tiny_config
from torchcls import machine
from torchcls.machine import CpuBudget, ThreadChoice, choose_threads
from torchcls.training import thread_tuning
from torchcls.training.thread_tuning import (
    children_cpu_seconds,
    recorded_reservation,
    reservation,
    retuned,
    tuner_for,
    window,
    worker_load,
)

EIGHT = CpuBudget(8, 8, None)


# ---------------------------------------------------------------- the decision

def test_idle_workers_give_their_cores_back_and_busy_ones_keep_them():
    start = choose_threads(0, 2, EIGHT, env={}, busy=(0, ""))
    assert (start.threads, start.reserved) == (6, 2)
    assert retuned(start, 0.0) == 8  # prefetch done, cheap decodes: every usable CPU trains
    assert retuned(start, 0.08) == 8  # within the tick noise of a short window: idle
    assert retuned(start, 0.7) == 7  # one CPU's worth of decoding keeps one core
    assert retuned(start, 1.9) == 6  # both workers busy: the reservation stays
    assert retuned(start, 5.0) == 6  # never more than reserved at the start (the old rule's maximum)
    assert [reservation(x, 2) for x in (0.0, 0.1, 0.11, 1.1, 1.2, 9.0)] == [0, 0, 1, 1, 2, 2]


def test_other_work_stays_left_out_when_the_workers_give_back():
    start = choose_threads(0, 2, EIGHT, env={}, busy=(3, "other work kept 3.0 of 8 CPU(s) busy"))
    assert (start.threads, start.reserved) == (3, 2)
    assert retuned(start, 0.0) == 5  # the busy CPUs stay out: only the workers' reservation comes back
    crowded = choose_threads(0, 2, CpuBudget(2, 2, None), env={}, busy=(1, "other work kept 1.0 of 2 CPU(s) busy"))
    assert (crowded.threads, crowded.reserved) == (1, 0)  # one thread either way: the reservation took nothing
    assert tuner_for(crowded, None, 100, {}, single_cpu_process=True) is None


def test_a_count_the_user_fixed_is_never_retuned(tmp_path):
    path, fixed = tmp_path / "machine.json", {"OMP_NUM_THREADS": "3"}
    for choice in (choose_threads(4, 2, EIGHT, env={}), choose_threads(0, 2, EIGHT, env=fixed),
                   choose_threads(0, 0, EIGHT, env={})):  # --threads, OMP_NUM_THREADS, no workers
        assert choice.reserved == 0
        assert tuner_for(choice, path, 100, {}, single_cpu_process=True) is None
    rule = choose_threads(0, 2, EIGHT, env={})
    assert tuner_for(rule, path, 100, {}, single_cpu_process=False) is None  # torchrun, or a GPU
    assert tuner_for(rule, path, 1, {}, single_cpu_process=True) is None  # an epoch too short to measure
    assert tuner_for(rule, path, 100, {}, single_cpu_process=True) is not None


def test_the_window_is_early_in_the_first_epoch_and_counted_in_steps():
    assert window(1000) == (5, 55) and window(40) == (5, 22) and window(8) == (2, 5)
    assert window(2) == (0, 1) and window(1) is None and window(0) is None


def test_worker_load_is_cpu_seconds_over_wall_seconds():
    before = {(10, 1.0): 2.0, (11, 1.0): 5.0, (12, 1.0): 1.0}
    after = {(10, 1.0): 3.0, (11, 1.0): 5.5, (13, 2.0): 0.5}  # 12 ended, 13 started in the window
    assert worker_load(before, after, wall_s=2.0) == pytest.approx((1.0 + 0.5 + 0.5) / 2.0)
    assert worker_load({(10, 1.0): 9.0}, {(10, 5.0): 1.0}, 1.0) == 1.0  # a reused pid is another process
    assert worker_load(before, after, wall_s=0.0) == 0.0


class _Child:
    def __init__(self, pid, user, system, gone=False):
        self.pid, self.times, self.gone = pid, (user, system), gone

    def oneshot(self):
        return psutil.Process().oneshot()  # (a context manager; the fake reads nothing through it)

    def cpu_times(self):
        if self.gone:
            raise psutil.NoSuchProcess(self.pid)
        return type(psutil.Process().cpu_times())(*self.times, 0.0, 0.0, 0.0)

    def create_time(self):
        return 100.0 + self.pid


class _Parent:
    def children(self, recursive=False):
        assert recursive  # a worker's own children (a decoder's subprocess) count too
        return [_Child(7, 1.5, 0.5), _Child(8, 0.25, 0.0), _Child(9, 1.0, 1.0, gone=True)]


def test_children_cpu_seconds_reads_user_and_system_time_of_each_live_child():
    assert children_cpu_seconds(_Parent()) == {(7, 107.0): 2.0, (8, 108.0): 0.25}
    assert all(cpu >= 0 for cpu in children_cpu_seconds().values())  # this process's own children


def test_a_recorded_reservation_is_bounded_by_the_rule(monkeypatch):
    monkeypatch.setattr(thread_tuning, "cpu_budget", lambda: EIGHT)
    assert recorded_reservation({"threads_reserved_for_workers": 2}) == 2
    assert recorded_reservation({"threads_reserved_for_workers": 10**9}) == 4  # half the usable CPUs
    assert recorded_reservation({"threads_reserved_for_workers": "2"}) == 0
    assert recorded_reservation({}) == 0  # a run from before the measurement: its count stays


# ---------------------------------------------------------------- a run

@pytest.fixture
def idle_workers(monkeypatch):
    """No other work at the start and workers that use no CPU in the window: the decision is known in advance
    (threads = usable - reserved, then = usable), whatever else this machine runs."""
    if len(machine.usable_cpus()) < 2 or machine.cpu_budget().usable < 2:
        pytest.skip("needs two usable CPUs")
    monkeypatch.setattr(machine.CpuActivity, "busy", lambda self: (0, ""))
    monkeypatch.setattr(thread_tuning, "children_cpu_seconds", lambda process=None: {})
    before = torch.get_num_threads()
    yield machine.cpu_budget().usable
    torch.set_num_threads(before)


def _config(data, out, name, epochs):
    cfg = tiny_config(data, out, name, epochs=epochs)  # 64 training images, 8 a step: window (2, 5)
    cfg.train.threads, cfg.data.workers, cfg.data.in_memory = 0, 2, "off"  # the rule, and worker processes
    return cfg


def _threads_per_step(seen, stop_at=None):
    def record(step):
        seen[step] = torch.get_num_threads()  # after the tuner, which runs first: the count from the next step on
        if step == stop_at:
            raise KeyboardInterrupt
    return record


@pytest.mark.slow  # seven short runs with worker processes
def test_a_run_records_the_measured_count_and_a_resume_keeps_it(tmp_path, idle_workers, capsys):
    usable = idle_workers
    data = make_image_folder(tmp_path / "shapes", per_class=40)
    full_seen = {}
    full = train_run(_config(data, tmp_path, "full", 2), _threads_per_step(full_seen))
    record = json.loads((full.run_dir / "machine.json").read_text())
    start = usable - min(2, usable // 2)
    assert (record["torch_threads"], record["threads_reserved_for_workers"]) == (start, min(2, usable // 2))
    assert (record["threads_after_measurement"], record["worker_load_cpus"], record["measured_over_steps"]) == \
        (usable, 0.0, [2, 5])
    assert "usable CPU(s)" in record["threads_reason"]  # the keys from before stay
    assert f"threads {start} -> {usable} after step 5: loader workers kept 0.00 CPU(s) busy" in capsys.readouterr().out
    assert [full_seen[s] for s in sorted(full_seen)] == [start] * 4 + [usable] * 12

    for stop in (3, 8):  # inside the window (measured again at step 5), past it (the recorded count from the start)
        seen = {}
        cfg = _config(data, tmp_path, f"cut{stop}", 2)
        assert train_run(cfg, _threads_per_step(seen, stop_at=stop)).interrupted
        cfg.run.resume = True
        resumed = train_run(cfg, _threads_per_step(seen))
        assert seen == full_seen, stop
        assert json.loads((resumed.run_dir / "machine.json").read_text())["threads_after_measurement"] == usable
        a, b = load_file(full.last_checkpoint), load_file(resumed.last_checkpoint)
        assert all(torch.equal(a[k], b[k]) for k in a), stop  # bit for bit, as an uninterrupted run


def test_a_resume_with_threads_given_keeps_them(tmp_path, idle_workers):
    data = make_image_folder(tmp_path / "shapes", per_class=40)
    cfg = _config(data, tmp_path, "run", 1)
    train_run(cfg)
    seen = {}
    cfg.train.epochs, cfg.run.resume, cfg.train.threads = 2, True, 1
    run = train_run(cfg, _threads_per_step(seen)).run_dir
    assert set(seen.values()) == {1}
    assert "threads_after_measurement" not in json.loads((run / "machine.json").read_text())


def test_the_measurement_on_this_machine_is_recorded_consistently(tmp_path, monkeypatch):
    """Real readings of real workers: whatever the load, the count follows the rule from it."""
    if machine.cpu_budget().usable < 2:
        pytest.skip("needs two usable CPUs")
    monkeypatch.setattr(machine.CpuActivity, "busy", lambda self: (0, ""))  # (other work would take the reservation)
    before = torch.get_num_threads()
    try:
        cfg = _config(make_image_folder(tmp_path / "shapes", per_class=40), tmp_path, "real", 1)
        record = json.loads((train_run(cfg).run_dir / "machine.json").read_text())
    finally:
        torch.set_num_threads(before)
    start = ThreadChoice(record["torch_threads"], "", record["threads_reserved_for_workers"])
    assert start.reserved >= 1 and record["worker_load_cpus"] >= 0 and record["measured_over_steps"] == [2, 5]
    assert record["threads_after_measurement"] in {retuned(start, record["worker_load_cpus"] + d)
                                                   for d in (-0.001, 0.0, 0.001)}  # (the load is rounded)
    assert os.cpu_count() >= record["threads_after_measurement"] >= start.threads


def train_run(cfg, *callbacks):
    from torchcls.training import train

    return train(cfg, callbacks=list(callbacks))


def test_a_resumed_runs_machine_record_is_read_as_data(tmp_path):
    from torchcls.errors import UserError
    from torchcls.training.thread_tuning import read_record

    assert read_record(tmp_path / "machine.json") == {}  # a run from before machine.json: the rule applies
    (tmp_path / "machine.json").write_text("{not json")
    with pytest.raises(UserError, match="machine.json: not a JSON machine record"):
        read_record(tmp_path / "machine.json")
    (tmp_path / "elsewhere.json").write_text('{"torch_threads": 64}')
    (tmp_path / "machine.json").unlink()
    (tmp_path / "machine.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UserError, match="symbolic link"):  # never read through a link out of the run dir
        read_record(tmp_path / "machine.json")
