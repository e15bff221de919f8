"""Real layouts (train/val/test folders, --val-data, CSV split column), the header-only scan,
and bad files met at decode time or while listing: reported, never dropped silently."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from PIL import Image

from conftest import make_image_folder
from torchcls.config import DataConfig
from torchcls.data import BadSampleError, build_data, eval_dataset, make_loader, open_source, read_skips
from torchcls.data.scan import list_files
from torchcls.errors import UserError


def _split_tree(root: Path, counts: dict[str, int]) -> Path:
    for split, n in counts.items():
        make_image_folder(root / split, per_class=n)
    return root


def _corrupt_after_header(path: Path) -> None:
    """A PNG whose header reads fine but whose pixel data fails to decode."""
    raw = bytearray(path.read_bytes())
    raw[60:120] = b"\x00" * 60
    path.write_bytes(bytes(raw))


def test_split_folders_are_splits_not_classes(tmp_path):
    root = _split_tree(tmp_path / "ds", {"train": 6, "val": 3, "test": 2})
    bundle = build_data(DataConfig(source=str(root), img_size=16, workers=0), seed=0)
    assert bundle.classes == ["circle", "square"]
    assert (len(bundle.train), len(bundle.val)) == (12, 6)  # val/ is used whole; --val-fraction does not apply
    assert bundle.splits["val"]["source"] == str(root / "val") and bundle.splits["val"]["images"] == 6
    assert "test" in bundle.splits
    bundle.write_splits(tmp_path)
    assert json.loads((tmp_path / "data_splits.json").read_text())["train"]["images"] == 12
    pre = bundle.preprocess
    cfg = DataConfig(source=str(root), img_size=16)
    assert len(eval_dataset(cfg, pre, "test", 0)[0]) == 4
    assert len(eval_dataset(cfg, pre, "val", 0)[0]) == 6 and len(eval_dataset(cfg, pre, "train", 0)[0]) == 12


def test_val_data_replaces_val_fraction(tmp_path):
    train = make_image_folder(tmp_path / "train", per_class=5)
    val = make_image_folder(tmp_path / "holdout", per_class=2)
    bundle = build_data(DataConfig(source=str(train), val_data=str(val), img_size=16, workers=0), seed=0)
    assert (len(bundle.train), len(bundle.val)) == (10, 4) and bundle.splits["val"]["how"] == "--val-data"
    other = make_image_folder(tmp_path / "other", per_class=2, classes=("circle", "triangle"))
    with pytest.raises(UserError, match=r"other: its classes differ .*missing: square; extra: triangle"):
        build_data(DataConfig(source=str(train), val_data=str(other), workers=0), seed=0)


def test_mistyped_split_folder_and_different_classes(tmp_path):
    root = _split_tree(tmp_path / "ds", {"train": 2, "valid": 2})
    with pytest.raises(UserError, match=r"'valid/' is not a split name. Rename it to val/"):
        build_data(DataConfig(source=str(root), workers=0), seed=0)
    root = _split_tree(tmp_path / "ds2", {"train": 2})
    make_image_folder(root / "val", per_class=1, classes=("circle", "star"))
    with pytest.raises(UserError, match=r"ds2/val: its class folders differ .*missing: square; extra: star"):
        open_source(str(root), None, "train", None, "error")
    plain = make_image_folder(tmp_path / "plain", per_class=2)
    with pytest.raises(UserError, match="has no test/ folder"):
        open_source(str(plain), None, "test", None, "error")


def test_csv_split_column(tmp_path, shapes_dir):
    files = sorted(shapes_dir.rglob("*.png"))
    lines = ["path,label,split"] + [f"{p.relative_to(shapes_dir)},{p.parent.name},{'val' if i % 4 == 0 else 'train'}"
                                    for i, p in enumerate(files)]
    manifest = tmp_path / "m.csv"
    manifest.write_text("\n".join(lines) + "\n")
    bundle = build_data(DataConfig(source=str(manifest), root=str(shapes_dir), img_size=16, workers=0), seed=0)
    assert (len(bundle.train), len(bundle.val)) == (24, 8) and bundle.splits["val"]["source"].endswith("split=val")
    manifest.write_text("\n".join(lines[:3] + ["circle/circle_000.png,circle,valid"]) + "\n")
    with pytest.raises(UserError, match="line 4: split 'valid' is not one of train, val, test"):
        open_source(str(manifest), str(shapes_dir), "train", None, "error")


def test_file_failing_only_at_decode_is_skipped_and_listed(tmp_path):
    root = make_image_folder(tmp_path / "d", per_class=6)
    bad = root / "circle" / "circle_002.png"
    _corrupt_after_header(bad)
    bundle = build_data(DataConfig(source=str(root), img_size=16, val_fraction=0.0, on_bad_file="skip"), seed=0)
    assert len(bundle.train) == 12 and not bundle.skipped  # the header scan cannot see it
    run = tmp_path / "run"
    run.mkdir()
    bundle.log_skips_to(run, rank=0)
    seen = sum(len(y) for _, y in make_loader(bundle.train, 5, workers=2, shuffle=True))
    assert seen == 11  # left out of its batch; the workers and the epoch went on
    assert [d["file"] for d in read_skips(run)] == [str(bad)]
    assert bundle.write_skipped_files(run) == 1
    entry = json.loads((run / "skipped_files.json").read_text())["skipped_files"][0]
    assert entry["stage"] == "decode" and "truncated or corrupted" in entry["reason"]


def test_skips_of_every_rank_are_read_back_once_per_file(tmp_path):
    """Under torchrun each rank logs to its own file; the main process merges them."""
    root = make_image_folder(tmp_path / "d", per_class=2)
    bad = root / "circle" / "circle_001.png"
    _corrupt_after_header(bad)
    for rank in (0, 1):
        bundle = build_data(DataConfig(source=str(root), img_size=16, val_fraction=0.0, on_bad_file="skip"), seed=0)
        bundle.log_skips_to(tmp_path, rank)
        for epoch in range(2):
            list(make_loader(bundle.train, 4, workers=0, shuffle=False))
    assert sorted(p.name for p in tmp_path.glob("decode_skips.*")) == ["decode_skips.rank0.jsonl",
                                                                     "decode_skips.rank1.jsonl"]
    assert read_skips(tmp_path) == [{"file": str(bad), "reason": read_skips(tmp_path)[0]["reason"], "times": 4}]


def test_file_failing_at_decode_under_error_names_it_without_traceback(tmp_path):
    root = make_image_folder(tmp_path / "d", per_class=3)
    bad = root / "square" / "square_001.png"
    _corrupt_after_header(bad)
    bundle = build_data(DataConfig(source=str(root), img_size=16, val_fraction=0.0), seed=0)
    with pytest.raises(BadSampleError) as e:
        for _ in make_loader(bundle.train, 6, workers=1, shuffle=False):
            pass
    assert str(e.value).startswith(str(bad)) and "Traceback" not in str(e.value)
    assert "--on-bad-file skip" in str(e.value)


def test_a_batch_of_only_bad_files_is_empty_not_an_error(tmp_path):
    root = make_image_folder(tmp_path / "d", per_class=2)
    for p in (root / "circle").iterdir():
        _corrupt_after_header(p)
    bundle = build_data(DataConfig(source=str(root), img_size=16, val_fraction=0.0, on_bad_file="skip"), seed=0)
    batches = [(x.shape, len(y)) for x, y in make_loader(bundle.train, 2, workers=0, shuffle=False)]
    assert batches == [((0, 3, 16, 16), 0), ((2, 3, 16, 16), 2)]
    assert len(bundle.train.decode_skipped) == 2


def test_listing_reports_broken_symlinks_dirs_named_like_images_and_unreadable(tmp_path):
    root = make_image_folder(tmp_path / "d", per_class=3)
    (root / "circle" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    (root / "square" / "folder.jpg").mkdir()
    (root / "square" / "link.png").symlink_to(root / "square" / "square_000.png")  # a good link is a file
    with pytest.raises(UserError, match="2 unreadable image file") as e:
        open_source(str(root), None, "train", None, "error")
    assert "gone.png: broken symlink" in str(e.value) and "folder.jpg: a directory named like an image" in str(e.value)
    s = open_source(str(root), None, "train", None, "skip")
    assert len(s) == 7 and sorted(Path(f).name for f, _ in s.skipped) == ["folder.jpg", "gone.png"]


def test_unreadable_folder_is_reported(tmp_path):
    """A folder the process cannot read is reported, not skipped silently. Root reads everything, so as root
    (CI) the listing runs in a forked child that has dropped to `nobody` first."""
    base = Path(tempfile.mkdtemp(dir="/tmp")) if os.geteuid() == 0 else tmp_path  # nobody must reach it
    try:
        base.chmod(0o755)
        root = make_image_folder(base / "d", per_class=3)
        locked = root / "circle" / "locked"
        locked.mkdir()
        locked.chmod(0)
        problems = _as_unprivileged(lambda: list_files(root / "circle").problems)
        assert any("locked" in f and "permission denied" in r for f, r in problems), problems
    finally:
        if base != tmp_path:
            shutil.rmtree(base)


def _as_unprivileged(fn):
    """fn() in this process, or as root: in a forked child running as nobody (uid/gid 65534); its result
    comes back as JSON through a pipe."""
    if os.geteuid() != 0:
        return fn()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, run, report, exit without running the parent's cleanup
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write_end, json.dumps(fn()).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged child failed"
    return json.loads(out)


def test_predict_reports_broken_symlinks(tmp_path, trained_run):
    from torchcls.prediction import predict

    folder = make_image_folder(tmp_path / "p", per_class=1)
    (folder / "circle" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    preds = predict(trained_run, [folder], on_bad_file="skip")
    assert len(preds.items) == 2 and preds.skipped[0]["file"].endswith("gone.png")
    assert "broken symlink" in preds.skipped[0]["reason"]


def test_scan_reads_headers_not_pixels(tmp_path):
    """A file whose pixels are broken passes the scan: the scan never decodes."""
    root = make_image_folder(tmp_path / "d", per_class=3)
    _corrupt_after_header(root / "circle" / "circle_000.png")
    s = open_source(str(root), None, "train", None, "error")
    assert len(s) == 6 and s.formats[0] == "PNG" and s.sizes[0].tolist() == [32, 32]


def test_max_pixels_below_the_input_size_is_refused(shapes_dir):
    with pytest.raises(UserError, match=r"--max-pixels 100: below the model's input of 32x32"):
        build_data(DataConfig(source=str(shapes_dir), img_size=32, max_pixels=100), seed=0)


def test_too_large_files_are_found_at_start_not_mid_epoch(tmp_path):
    root = make_image_folder(tmp_path / "d", per_class=3)
    Image.new("RGB", (200, 100)).save(root / "square" / "big.png")
    with pytest.raises(UserError, match=r"big.png: 200x100 = 20,000 pixels is above the --max-pixels limit"):
        build_data(DataConfig(source=str(root), img_size=16, max_pixels=10_000), seed=0)
    bundle = build_data(DataConfig(source=str(root), img_size=16, max_pixels=10_000, on_bad_file="skip"), seed=0)
    assert len(bundle.images) == 6 and bundle.skipped[0][0].endswith("big.png")


def test_evaluation_count_equals_the_validation_folder(tmp_path, trained_run):
    from torchcls.evaluation.evaluator import evaluate

    root = _split_tree(tmp_path / "ds", {"train": 4, "val": 5, "test": 3})
    assert evaluate(trained_run, data=str(root), split="val", out_dir=tmp_path / "e", workers=0)["n"] == 10
    assert evaluate(trained_run, data=str(root), split="test", out_dir=tmp_path / "e", workers=0)["n"] == 6
    assert evaluate(trained_run, data=str(root), out_dir=tmp_path / "e", workers=0)["split"] == "val"
    with pytest.raises(UserError, match="holds the splits test, train, val: choose one"):
        evaluate(trained_run, data=str(root), split="all", out_dir=tmp_path / "e", workers=0)
