"""`torchcls report`: every section renders with its data, and says 'not run' without it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

SECTIONS = ("misclassified", "training", "evaluation", "exports", "compile", "memory", "audit", "config")
# Sections of features whose own tests render them with real runs (precision, distributed, bench memory,
# early-exit, governance tests); here they only have to say "not run" when their data is absent.
FEATURE_SECTIONS = ("samples", "precision", "early_exit", "rank_memory", "bench_memory", "governance")


def _not_run(html: str) -> set[str]:
    return set(re.findall(r"data-section='(\w+)'", html))


def test_empty_dir_says_not_run_everywhere(tmp_path):
    from torchcls.report import write_report

    html = write_report(tmp_path).read_text()
    assert _not_run(html) == set(SECTIONS) | set(FEATURE_SECTIONS)
    assert "torchcls bench compile" in html and "torchcls audit kernels" in html
    # One closing line for all of them, each with what fills it; no heading apiece.
    line = re.search(r"<p id='not-run' class='notrun'>Not run: (.*?)</p>", html).group(1)
    assert _not_run(line) == _not_run(html) and "<h2>" not in html
    assert "Training samples (<code>torchcls train --sample-grid N" in line


def _results(run: Path) -> None:
    """Result files as the commands write them (memory from a real recorder, the rest in their formats)."""
    import torch

    from torchcls.memory.recorder import MemoryRecorder

    (run / "exports" / "aoti").mkdir(parents=True)
    (run / "exports" / "aoti" / "model.pt2").write_bytes(b"x")
    (run / "exports" / "aoti" / "parity.json").write_text(json.dumps(
        {"max_abs_diff": 4.8e-6, "top1_agreement": 1.0, "passed": True, "batch": {"min": 1, "max": 64}}))
    result = {"model": "smallnet", "batch": 16, "precision": "fp32", "mode": "default", "status": "ok",
              "eager_ms": {"median": 2.0, "min": 1.9, "max": 2.4}, "compiled_ms": {"median": 1.0, "min": 0.9, "max": 1.1},
              "speedup": 2.0, "compile_s": 12.5, "graphs": 1, "graph_breaks": 0, "recompiles": 1, "max_abs_diff": 1e-6}
    (run / "bench_compile.json").write_text(json.dumps({"machine": {"note": "test"}, "results": [result],
                                                        "verdicts": {"smallnet": "compile pays 2.00× at b16"}}))
    rec = MemoryRecorder(run, torch.device("cpu"))
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(1, 6):
        model(torch.randn(16, 64)).sum().backward()
        opt.step()
        rec(step)
    rec.finish()
    (run / "kernel_audit.json").write_text(json.dumps({
        "imports": ["kernels_example"], "device": {"capability": None}, "passed": False, "failures": ["x::y: opcheck"],
        "ops": [{"name": "x::y", "dispatch_keys": ["CPU"], "traceable": False, "status": "fail",
                 "checks": [{"name": "opcheck", "status": "fail", "detail": "test_faketensor failed", "fix": "fix fake"}]}],
        "binaries": [{"path": "/a/_C.so", "sm": ["sm_80"], "ptx": [], "check": {"status": "skip", "detail": "no GPU"}}],
        "triton_kernels": [], "model": {"target": "m", "exported": True, "custom_ops": {"x::y": 2}, "error": None}}))


def test_every_section_renders_with_data(trained_run, tmp_path, capsys):
    from torchcls.cli import main
    from torchcls.evaluation import evaluate

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    evaluate(run, workers=0)
    _results(run)
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    html = (run / "report.html").read_text()
    assert _not_run(html) <= set(FEATURE_SECTIONS)  # every evaluation-guide section has its data
    assert out.count("included") == len(SECTIONS) + len(FEATURE_SECTIONS) - len(_not_run(html))
    for text in ("top1_agreement", "model.pt2", "compile pays 2.00× at b16", "alt=\"bench_compile\"",
                 "need a CUDA device", "alt=\"memory\"", "fix fake", "sm_80", "x::y ×2", "alt=\"curves\""):
        assert text in html, text


def test_cuda_memory_section_renders(tmp_path):
    """The CUDA variant of allocator.json (as the recorder writes it on a GPU) renders its figures and advice."""
    from torchcls.memory.allocator import sample, summarize
    from torchcls.report import write_report

    samples = [sample({"allocated_bytes.all.current": 2**30, "reserved_bytes.all.current": 2**31,
                       "inactive_split_bytes.all.current": 2**30}, 1)]
    a = summarize({"allocated_bytes.all.peak": 2**30, "reserved_bytes.all.peak": 2**31, "num_alloc_retries": 0},
                  samples)
    (tmp_path / "allocator.json").write_text(json.dumps({"device": "cuda:0", "cuda": True, "samples": samples,
        "allocator": {"available": True} | a, "snapshot": {"file": "memory_snapshot.pickle"}}))
    html = write_report(tmp_path).read_text()
    assert "50.0%" in html and "expandable_segments:True" in html and "memory_snapshot.pickle" in html
    assert "memory" not in _not_run(html)


def test_worst_errors_gallery_shows_each_with_its_labels(tmp_path):
    """The misclassified images the model was surest of, most confident first, with predicted and true labels."""
    import torch

    from conftest import make_image_folder
    from torchcls.data.loaders import Transformed
    from torchcls.data.sources import open_source
    from torchcls.evaluation.worst_errors import worst_errors
    from torchcls.report import write_report

    images = open_source(str(make_image_folder(tmp_path / "shapes", per_class=3, size=120)), None, "train", 3, "error")
    dataset = Transformed(images, torch.arange(len(images)), lambda x: x)
    targets = images.targets.clone()  # 0 0 0 1 1 1: circles, then squares
    logits = torch.zeros(6, 2)
    logits[torch.arange(6), targets] = 1.0  # right, with little confidence
    logits[1] = torch.tensor([0.0, 3.0])  # a circle taken for a square, surely
    logits[4] = torch.tensor([1.0, 0.0])  # a square taken for a circle, barely
    run = tmp_path / "run"
    found = worst_errors(logits, targets, dataset, images.classes, run)
    assert [(e["true"], e["predicted"]) for e in found] == [("circle", "square"), ("square", "circle")]
    assert found[0]["confidence"] > found[1]["confidence"] and found[0]["file"].endswith("circle_001.png")
    from PIL import Image

    assert max(Image.open(run / found[0]["thumbnail"]).size) == 96  # 120 px images, shrunk for the page
    (run / "eval.json").write_text(json.dumps({"data": "shapes", "split": "val", "n": 6, "top1": 4 / 6,
                                               "misclassified": found}))
    html = write_report(run).read_text()
    assert re.search(r"<section id='(\w+)'", html).group(1) == "misclassified"  # first in the page
    assert "<b class='wrong'>square</b> 95%<br>true: <b>circle</b>" in html and html.count("<figure>") == 2
    assert html.count('src="data:image/png;base64,') >= 2


def test_curves_leave_out_what_draws_nothing():
    from torchcls.report.plots import curve_lines

    epochs = [{"kind": "epoch", "epoch": e, "step": 2 * e, "train_loss": 1.0, "train_top1": 0.5, "val_loss": 1.0,
               "val_top1": 0.5, "val_top5": 1.0} for e in (1, 2)]
    one_step = [{"kind": "step", "epoch": 1, "step": 1, "loss": 1.0}]
    loss, accuracy = curve_lines(one_step + epochs, classes=3)
    assert [c["label"] for c in loss] == ["train loss", "val loss"]  # no "step loss" legend for a single point
    assert [c["label"] for c in accuracy] == ["train top-1", "val top-1"]  # 3 classes: top-5 is always 100%
    two_steps = one_step + [{"kind": "step", "epoch": 1, "step": 2, "loss": 0.5}]
    loss, accuracy = curve_lines(two_steps + epochs, classes=10)
    assert loss[0]["label"] == "step loss" and accuracy[-1]["label"] == "val top-5"


def _drawn(monkeypatch) -> list:
    """The figures report.plots saves from now on, each as (width px, height px, bars, title)."""
    from torchcls.report import plots

    drawn, save = [], plots.save_figure

    def keep(fig, path, dpi):
        save(fig, path, dpi)
        ax = fig.axes[0]
        drawn.append((*(fig.get_size_inches() * dpi).round(), len(ax.patches), ax.get_title()))

    monkeypatch.setattr(plots, "save_figure", keep)
    return drawn


def test_bar_figures_are_not_sized_by_the_records_a_file_lists(tmp_path, monkeypatch):
    """Review 3, finding 4: a figure 1.1 in per bar of a received bench_compile.json (76,000 rows, 6 MB) was a
    12.7 GB canvas. A bar chart draws the first MAX_BARS records, its title saying how many of all, and no
    figure exceeds MAX_FIGURE_INCHES; a few records draw as before."""
    import matplotlib.image

    from torchcls.report import plots

    drawn = _drawn(monkeypatch)
    many = 5 * plots.MAX_BARS
    row = {"model": "m", "batch": 1, "precision": "fp32", "mode": "default", "speedup": 1.5}
    assert plots.compile_speedups([row] * many, tmp_path / "c.png")
    ranks = [{"rank": i, "param_bytes": 2**20, "grad_bytes": 2**20, "optimizer_bytes": 2**20,
              "expected_state_bytes": 3 * 2**20} for i in range(many)]
    assert plots.rank_memory_bars([{"parallel": "fsdp2", "world": many, "status": "ok", "ranks": ranks}],
                                  tmp_path / "m.png")
    assert plots.compile_speedups([row] * 3, tmp_path / "few.png")
    limit = [v * 100 for v in plots.MAX_FIGURE_INCHES]  # both draw at 100 dpi
    (cw, ch, cbars, ctitle), (mw, mh, mbars, mtitle), (fw, fh, fbars, ftitle) = drawn
    assert cbars == plots.MAX_BARS and f"first {plots.MAX_BARS} of {many:,} configurations" in ctitle
    assert mbars == 3 * plots.MAX_BARS and f"first {plots.MAX_BARS} of {many:,} ranks" in mtitle  # 3 stacked
    assert cw <= limit[0] and ch <= limit[1] and mw <= limit[0] and mh <= limit[1]
    assert matplotlib.image.imread(tmp_path / "c.png").shape[1] <= limit[0]  # the file saved, too
    assert (fw, fbars, ftitle) == (600, 3, "torch.compile gains")  # 6 in at 100 dpi, as before


def test_save_figure_clamps_a_figure_made_elsewhere(tmp_path):
    import matplotlib.image
    import matplotlib.pyplot as plt

    from torchcls.report import plots

    fig, _ = plt.subplots(figsize=(500, 300))  # not through plots.subplots
    plots.save_figure(fig, tmp_path / "big.png", dpi=10)
    height, width = matplotlib.image.imread(tmp_path / "big.png").shape[:2]
    assert (width, height) == tuple(10 * v for v in plots.MAX_FIGURE_INCHES)


def test_governance_values_read_as_text(tmp_path):
    from torchcls.report import write_report

    (tmp_path / "governance.json").write_text(json.dumps({
        "lineage_id": "abc", "manifest": {"name": "mnist-5k", "records": 5000, "merkle_root": "f" * 64,
                                          "license": "CC-BY-SA-3.0", "jurisdiction": None, "tags": ["public"]},
        "samples": "not requested", "redacted_file_names": 0}))
    html = write_report(tmp_path).read_text()
    assert "<td>CC-BY-SA-3.0 / not given</td>" in html and "<td>not requested</td>" in html
    assert "None" not in html and "&quot;" not in html


PAYLOAD = "<x-injected onerror=alert(1)>"


def _poisoned(value, mode: str, pattern: tuple = (), at: tuple = (), hits: list | None = None):
    """`value` (a parsed JSON document) with markup put in: "strings": every string leaf replaced; "keys": every
    key extended; "number": the last number at `pattern` (keys, "*" for any list index) replaced, so that a
    page that expects a number there and does not escape it shows markup (the others, numbers still, let the
    rest of the section render). `hits`: [numbers at `pattern` to pass over, across a file's documents]."""
    if isinstance(value, dict):
        return {(k + PAYLOAD if mode == "keys" else k): _poisoned(v, mode, pattern, (*at, k), hits)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_poisoned(v, mode, pattern, (*at, "*"), hits) for v in value]
    if mode == "strings" and isinstance(value, str):
        return PAYLOAD
    if mode == "number" and at == pattern and isinstance(value, (int, float)) and not isinstance(value, bool):
        hits[0] -= 1
        return PAYLOAD if hits[0] == -1 else value
    return value


def _number_patterns(value, at: tuple = ()) -> list[tuple]:
    """The pattern of each number in `value`, in document order (one entry per number)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _number_patterns(v, (*at, k))]
    if isinstance(value, list):
        return [p for v in value for p in _number_patterns(v, (*at, "*"))]
    return [at] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def test_no_value_of_a_received_run_dir_reaches_the_page_as_markup(trained_run, tmp_path):
    """Every JSON record of a full run dir, one file at a time, with all its strings, or all its keys, or the
    numbers of one field replaced by markup: the page shows it as text, or refuses the section, never renders
    it; and the page tells the browser to run no script and load nothing in any case."""
    from torchcls.evaluation import evaluate
    from torchcls.report import write_report

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    evaluate(run, workers=0)
    _results(run)
    records = sorted(p for p in run.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    assert {"eval.json", "metrics.jsonl", "bench_compile.json", "kernel_audit.json"} <= {p.name for p in records}
    for path in records:
        original = path.read_text()
        docs = [json.loads(line) for line in original.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else [json.loads(original)]
        numbers = [p for d in docs for p in _number_patterns(d)]
        cases = [("strings", ()), ("keys", ())] + [("number", p) for p in sorted(set(numbers), key=str)]
        for mode, pattern in cases:
            hits = [numbers.count(pattern) - 1]
            path.write_text("\n".join(json.dumps(_poisoned(d, mode, pattern, hits=hits)) for d in docs) + "\n")
            assert "<x-injected" not in write_report(run).read_text(), (path.name, mode, pattern)
        path.write_text(original)
    head = write_report(run).read_text().split("</head>")[0]
    assert "Content-Security-Policy" in head and "default-src 'none'" in head and "<script" not in head


SUBSTITUTES = ([], {}, "x", None)  # (a number where an object is read fails as a string does)


def test_a_record_of_another_shape_leaves_the_page_written_and_says_so(trained_run, tmp_path):
    """Review 4, finding 9: an eval.json holding `[1]` was an AttributeError, and no page. Every JSON record of a
    full run dir, one file at a time: its top level replaced by a list, then all its top-level values at once by
    each JSON type in turn: the report is still written (the section refused or "could not read"), never a
    traceback."""
    from torchcls.evaluation import evaluate
    from torchcls.report import write_report

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    evaluate(run, workers=0)
    _results(run)
    records = sorted(p for p in run.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    for path in records:
        original = path.read_text()
        docs = [json.loads(line) for line in original.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else [json.loads(original)]
        for changed in [[[]] * len(docs)] + [[{k: sub for k in d} if isinstance(d, dict) else sub for d in docs]
                                             for sub in SUBSTITUTES]:
            path.write_text("\n".join(json.dumps(d) for d in changed) + "\n")
            page = write_report(run).read_text()  # an error of the wrong-type class would raise here
            assert "</html>" in page, (path.name, changed[0])
        path.write_text(original)
    eval_json = run / "eval.json"
    eval_json.write_text("[1]")
    page = write_report(run).read_text()
    assert f"refused: {eval_json}: a JSON list, where torchcls writes an object" in page
