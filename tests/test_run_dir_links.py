"""Symbolic links inside a received run dir are neither read through nor written through (run_files.py).

On 0bcf6c5 `torchcls report RUN` with RUN/report.html -> ../victim.txt overwrote victim.txt, and with
RUN/confusion_matrix.png -> ../secret.txt embedded secret.txt (base64) in report.html; eval.json's
thumbnail names and allocator.json's timeline name were joined to the run dir as given ('/etc/...',
'../..'). Now reads open with O_NOFOLLOW, names from the run dir's files must stay inside it, and every
write replaces the directory entry (a new file renamed over the name) or appends with O_NOFOLLOW."""

from __future__ import annotations

import ast
import base64
import html
import json
import os
import threading
from pathlib import Path

import pytest

from torchcls import run_files
from torchcls.config import Config
from torchcls.errors import UserError
from torchcls.report import write_report
from torchcls.training.rundir import RunDir, read_metrics

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- not for the report"
EVAL = {"data": "x", "split": "val", "top1": 0.5, "top5": 1.0, "n": 2, "macro_f1": 0.5, "ece": 0.1,
        "per_class": {"a": {"precision": 1, "recall": 1, "f1": 1, "support": 1}}, "classes": ["a"]}


@pytest.fixture
def received(tmp_path: Path) -> Path:
    """runs/alice as it arrives, beside the files of the user it was sent to."""
    run = tmp_path / "runs" / "alice"
    run.mkdir(parents=True)
    (tmp_path / "runs" / "victim.txt").write_text("the user's file\n")
    (tmp_path / "runs" / "secret.txt").write_bytes(SECRET)
    (run / "eval.json").write_text(json.dumps(EVAL))
    return run


def _leaked(html: str) -> bool:
    return SECRET in html.encode() or base64.b64encode(SECRET)[:24].decode() in html


def test_report_replaces_a_linked_report_html_and_embeds_no_linked_figure(received: Path) -> None:
    (received / "report.html").symlink_to("../victim.txt")
    (received / "confusion_matrix.png").symlink_to("../secret.txt")
    out = write_report(received)
    assert (received.parent / "victim.txt").read_text() == "the user's file\n"  # 0bcf6c5: overwritten
    assert not out.is_symlink() and out.is_file()
    html = out.read_text()
    assert not _leaked(html)
    assert "figure refused" in html and "confusion_matrix.png" in html and "symbolic link" in html


@pytest.mark.parametrize("name", ["../secret.txt", "/{root}/runs/secret.txt", "sub/../../secret.txt", 7])
def test_a_thumbnail_named_by_eval_json_must_be_inside_the_run_dir(received: Path, name) -> None:
    name = name.format(root=received.parent.parent) if isinstance(name, str) else name
    ev = {**EVAL, "misclassified": [{"file": "f.png", "true": "a", "predicted": "b", "confidence": 0.9,
                                     "thumbnail": name}]}
    (received / "eval.json").write_text(json.dumps(ev))
    html = write_report(received).read_text()
    assert not _leaked(html) and "is not a path inside the run dir" in html


def test_a_link_on_the_way_to_a_named_file_is_refused(received: Path) -> None:
    (received / "misclassified").symlink_to(received.parent)  # a folder link: misclassified/secret.txt
    with pytest.raises(UserError, match="a folder in a run dir is a symbolic link"):
        run_files.inside(received, "misclassified/secret.txt")
    with pytest.raises(UserError, match="symbolic link"):
        run_files.sub_dir(received / "misclassified")  # what the evaluation's thumbnails would be written into
    assert run_files.inside(received, "misclassified2/00.png") == received / "misclassified2" / "00.png"


def test_the_memory_timeline_named_by_allocator_json_stays_inside(received: Path) -> None:
    report = {"allocator": {"available": False, "reason": "cpu"}, "profiler": {"timeline_file": "../secret.txt"}}
    (received / "allocator.json").write_text(json.dumps(report))
    page = html.unescape(write_report(received).read_text())
    assert not _leaked(page) and "memory timeline '../secret.txt' is not a path inside the run dir" in page


def test_a_linked_record_is_refused_by_name_not_read(received: Path) -> None:
    (received / "eval.json").unlink()
    (received / "eval.json").symlink_to("../secret.txt")
    (received / "config.toml").symlink_to("../secret.txt")
    html = write_report(received).read_text()
    assert not _leaked(html) and html.count("symbolic link") >= 2


def test_writes_replace_a_link_and_leave_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    for name, write in (("eval.json", lambda p: run_files.write_text_atomic(p, "{}")),
                        ("x.bin", lambda p: run_files.write_bytes_atomic(p, b"\0")),
                        ("config.toml", Config().save_toml)):
        (run / name).symlink_to(victim)
        write(run / name)
        assert victim.read_text() == "mine" and not (run / name).is_symlink(), name
    assert sorted(p.name for p in run.iterdir()) == ["config.toml", "eval.json", "x.bin"]  # no temp file left


def test_a_new_file_gets_the_umask_mode_and_keeps_its_suffix(tmp_path: Path) -> None:
    seen = []
    run_files.replace_file(tmp_path / "fig.png", lambda tmp: (seen.append(tmp), Path(tmp).write_bytes(b"png")))
    assert seen[0].endswith(".png") and Path(seen[0]).parent == tmp_path
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "fig.png").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    (tmp_path / "eval.json").write_text("old")

    def fail(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        run_files.replace_file(tmp_path / "eval.json", fail)
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"] and (tmp_path / "eval.json").read_text() == "old"


def test_the_metrics_log_is_appended_never_through_a_link_or_into_a_fifo(tmp_path: Path) -> None:
    victim = tmp_path / "victim.jsonl"
    victim.write_text("")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.log({"step": 1})
    run.log({"step": 2})
    assert run.metrics_file.read_text() == '{"step": 1}\n{"step": 2}\n'
    run.metrics_file.unlink()
    run.metrics_file.symlink_to(victim)
    with pytest.raises(UserError, match="metrics log in a run dir is a symbolic link"):
        run.log({"step": 3})
    assert victim.read_text() == ""
    with pytest.raises(UserError, match="symbolic link"):  # nor read through one (the report, a resume)
        read_metrics(run.path)
    run.metrics_file.unlink()
    os.mkfifo(run.metrics_file)
    done = threading.Event()

    def append() -> None:
        with pytest.raises(UserError, match="FIFO"):
            run.log({"step": 4})
        done.set()

    threading.Thread(target=append, daemon=True).start()
    assert done.wait(10), "an append to a FIFO blocked"


def test_a_linked_checkpoints_folder_is_refused_before_training(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (elsewhere / ".last.dcp.old").mkdir()  # what a crashed commit leaves: recover() would rename it
    (run / "checkpoints").symlink_to(elsewhere)
    cfg = Config()
    cfg.run.out_dir, cfg.run.name, cfg.run.resume = str(tmp_path / "runs"), "r", True
    with pytest.raises(UserError, match="checkpoints folder in a run dir is a symbolic link"):
        RunDir.prepare(cfg)
    assert [p.name for p in elsewhere.iterdir()] == [".last.dcp.old"]



def test_a_linked_folder_on_the_way_to_an_export_is_refused_before_any_work(trained_run: Path, tmp_path: Path) -> None:
    """RUN/export -> a folder of the user's: export's default artifact path (export/<target>-<precision>/), and
    an --out inside the run dir the same way, would put model.pt2 and parity.json there."""
    import shutil

    from torchcls.artifacts import export

    run, victim = tmp_path / "runs" / "alice", tmp_path / "victim"
    shutil.copytree(trained_run, run)
    victim.mkdir()
    (run / "export").symlink_to(victim)
    for out in (None, run / "export" / "model.onnx", run / "export" / "sub"):
        with pytest.raises(UserError, match="export: a folder in a run dir is a symbolic link"):
            export(run, target="onnx", out=out, precision="fp32")
    assert list(victim.iterdir()) == []
    assert run_files.refuse_links_below(run, tmp_path / "elsewhere" / "model.onnx") is None  # outside: the user's


def test_a_linked_explain_folder_is_refused_and_the_run_dir_is_found_by_name(trained_run: Path,
                                                                             tmp_path: Path) -> None:
    """RUN/explain -> elsewhere is refused; RUN/checkpoints -> another run's makes that run's folder neither
    the one eval.json goes to nor the one the explain pictures go to (run_dir_of does not resolve links)."""
    import shutil

    from torchcls.checkpoint.files import run_dir_of

    run, other = tmp_path / "runs" / "alice", tmp_path / "runs" / "mine"
    shutil.copytree(trained_run, other)
    run.mkdir()
    shutil.copy(other / "config.toml", run / "config.toml")
    (run / "checkpoints").symlink_to(other / "checkpoints")
    assert run_dir_of(run / "checkpoints" / "best.safetensors") == run  # was `mine`: its eval.json replaced
    (run / "explain").symlink_to(tmp_path)
    with pytest.raises(UserError, match="the explain folder in a run dir is a symbolic link"):
        run_files.sub_dir(run / "explain", "the explain folder")


# What may still write by name in src/, and why it is not a file of a run dir. Everything else routes through
# run_files (replace_file / write_*_atomic / append_text), or writes into the temp file such a helper made.
WRITES_BY_NAME = {
    "training/rank_memory.py": "/proc/self/clear_refs",
    "training/step_choice.py": "the user's own cache (~/.cache), under its lock",
    "training/distributed.py": "os.devnull",
    "provenance/signing.py": "keygen --out: a new private key O_EXCL 0600, its public key beside it",
    "governance/isolate.py": "a folder mkdtemp made for this process",
    "provenance/trust.py": "the export record in the user's state dir (appended under flock)",
    "suite/memory_scaling_worker.py": "the result file its parent process named in its own temp dir",
    "data/shards.py": "the tars and index.json of a folder this process made (made_dirs), renamed into place whole",
    # An export builds into the temporary file the exporter made with mkstemp (O_EXCL) beside the artifact,
    # then checks it and renames it into place (artifacts/exporter.py _partial_file / _publish).
    "artifacts/targets/onnx.py": "the exporter's own mkstemp file",
    "artifacts/targets/executorch.py": "the exporter's own mkstemp file",
}


def _writes_by_name(tree: ast.AST) -> list[int]:
    """Lines of calls that write a file by its name: .write_text/.write_bytes/.savefig, an image's .save, and
    open() in a writing mode; a call inside a lambda that writes its own argument (the temp file) is not one."""
    temp_args = {id(n) for lam in ast.walk(tree) if isinstance(lam, ast.Lambda) for n in ast.walk(lam.body)
                 if isinstance(n, ast.Name) and n.id in {a.arg for a in lam.args.args}}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, args = node.func, node.args
        writes = isinstance(f, ast.Attribute) and (
            f.attr in ("write_text", "write_bytes", "savefig")
            or (f.attr == "save" and isinstance(f.value, ast.Name) and f.value.id in ("im", "img", "image", "pil")))
        positional = args[:1] if isinstance(f, ast.Attribute) else args[1:2]  # Path.open(mode) / open(path, mode)
        mode = next((a.value for a in [*positional, *(k.value for k in node.keywords if k.arg == "mode")]
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)), "")
        opens = (isinstance(f, ast.Name) and f.id == "open" or isinstance(f, ast.Attribute) and f.attr == "open") \
            and any(c in mode for c in "wa+") and "x" not in mode  # ('x': a new file, never through a link)
        if not (writes or opens):
            continue
        target = f.value.args[0] if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and f.value.args \
            else args[0] if args and not opens else None
        if target is not None and any(id(n) in temp_args for n in ast.walk(target)):
            continue  # a helper's temp file
        found.append(node.lineno)
    return found


def test_every_write_in_src_replaces_the_name_or_is_listed() -> None:
    src = Path(__file__).resolve().parents[1] / "src" / "torchcls"
    unlisted = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel == "run_files.py" or rel in WRITES_BY_NAME:
            continue
        unlisted += [f"{rel}:{n}" for n in _writes_by_name(ast.parse(path.read_text()))]
    assert not unlisted, f"writes by name (use torchcls.run_files, or list the file here with why): {unlisted}"


def test_the_write_scan_sees_writes_by_name_and_not_into_a_helpers_temp() -> None:
    code = ("(run / 'eval.json').write_text('{}')\nfig.savefig(path)\nwith open(p, 'a') as f: pass\n"
            "replace_file(p, lambda tmp: fig.savefig(tmp))\natomic_write(p, lambda t: Path(t).write_text('x'))\n"
            "with open(p, 'xb') as f: pass\nwith open(p) as f: pass\nwith path.open('a') as f: pass\n")
    assert _writes_by_name(ast.parse(code)) == [1, 2, 3, 8]


def test_a_linked_temporary_checkpoint_dir_is_replaced_not_written_through(tmp_path: Path) -> None:
    import torch

    from torchcls.checkpoint import dcp

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / ".last.dcp.tmp").symlink_to(elsewhere)  # as a received run dir could hold it

    class One:
        is_main, rank, world, active = True, 0, 1, True

        def barrier(self) -> None:
            pass

    dcp.start_save(checkpoints / "last.dcp", {"model": {"w": torch.ones(2)}}, One())
    assert list(elsewhere.iterdir()) == [] and not (checkpoints / ".last.dcp.tmp").is_symlink()


def test_consolidate_does_not_write_into_a_linked_checkpoints_folder(tmp_path: Path) -> None:
    """received/checkpoints -> the user's runs/prod/checkpoints: the default output, checkpoints/
    consolidated.safetensors, would replace prod's; refused before the checkpoint is read."""
    from torchcls.checkpoint import dcp
    from torchcls.checkpoint.consolidate import consolidate

    prod = tmp_path / "runs" / "prod" / "checkpoints"
    (prod / "last.dcp").mkdir(parents=True)
    for name in (dcp.STATE, dcp.META):
        (prod / "last.dcp" / name).write_text("{}")
    received = tmp_path / "received"
    received.mkdir()
    (received / "checkpoints").symlink_to(prod)
    with pytest.raises(UserError, match="checkpoints: a folder in a run dir is a symbolic link"):
        consolidate(received)
    assert sorted(p.name for p in prod.iterdir()) == ["last.dcp"]
