"""Bounded before built, for the data readers (issue 30's hostile review of the data layer): every number a data
source declares (an image file's size, a class count, a label, a multi-label matrix, a record line) is checked
against a stated bound before memory in proportion to it is spent, and a saved data set opens only the files it
holds. Each test names what the same input did before.
"""

from __future__ import annotations

import csv
import io
import json
import os
import resource
import tarfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from bounds_check import bounded
from torchcls.data.images import BadImage, load_image, read_header, read_image_file
from torchcls.data.sources import ImageSet, open_source
from torchcls.errors import UserError
from torchcls.models.registry import MAX_CLASSES


def png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


@contextmanager
def address_space(extra_gb: float = 2.0):
    """Caps this process's address space at its current size + `extra_gb` for the block, so that a reader that
    tries to allocate in proportion to a hostile number fails with MemoryError instead of taking the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + int(extra_gb * 2**30), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# --- image files are read whole, so their size is bounded (review: an 8x8 PNG padded to 64 GiB with
# `truncate -s 64G`, 4 KB on disk: load_image tried to allocate 64 GiB and raised a raw MemoryError) -----------

def test_a_sparse_image_file_is_a_bad_file_not_a_memory_error(tmp_path: Path):
    from torchcls.data.device_decode import EncodedSamples
    from torchcls.data.hf import _image_bytes
    from torchcls.data.shards import write_shards
    (tmp_path / "cls").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "cls" / "ok.png")
    big = tmp_path / "cls" / "a.png"
    big.write_bytes(png_bytes())
    os.truncate(big, 64 << 30)
    reason = "too large to read: 68,719,476,736 bytes, .*at most 268,435,456 bytes"
    images = ImageSet("x", ["cls"], torch.tensor([0]), 3, paths=[big])
    images.min_side, images.max_pixels = None, 64_000_000
    readers = {"load_image": lambda: load_image(big, 3, 28), "read_header (the start-up scan)": lambda: read_header(big),
               "read_image_file": lambda: read_image_file(big),
               "--decode device's worker": lambda: EncodedSamples._read(SimpleNamespace(ds=SimpleNamespace(
                   images=images)), 0),
               "a path in a table cell": lambda: _image_bytes(str(big), "image")}
    with address_space(), bounded(seconds=3.0, rss_mb=50):
        for name, read in readers.items():
            with pytest.raises(BadImage, match=reason):
                read()
        with pytest.raises(UserError, match="a.png: too large to read"):  # (a file grown after the scan)
            write_shards(images, tmp_path / "shards")
        found = open_source(str(tmp_path), None, "train", 3, "skip")
    assert found.paths == [tmp_path / "cls" / "ok.png"] and "too large to read" in found.skipped[0][1]


# --- a save_to_disk folder opens only files it holds (review: state.json's `_data_files` named /etc/hostname,
# `..` and deeper paths, and a FIFO at x/y/data.arrow, where datasets.load_from_disk waited forever) -----------

def saved_set(folder: Path, labels=(0, 1)) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"image": [png_bytes()] * len(labels), "label": list(labels)}).save_to_disk(str(folder))
    return folder


@pytest.mark.timeout(60)
def test_a_saved_folder_names_only_plain_files_beside_its_state(tmp_path: Path, monkeypatch):
    from torchcls.data.hf import hf_data_files, open_hf
    ds = saved_set(tmp_path / "ds")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets, "load_from_disk", lambda *a, **k: pytest.fail("datasets opened the folder"))
    assert len(open_hf(f"hf:{ds}")) == 2  # read by torchcls (pyarrow), never by datasets.load_from_disk
    (ds / "x" / "y").mkdir(parents=True)
    os.mkfifo(ds / "x" / "y" / "data.arrow")
    os.mkfifo(ds / "pipe.arrow")
    state = json.loads((ds / "state.json").read_text())
    arrow = state["_data_files"][0]["filename"]
    for name, reason in [("/etc/hostname", "'/etc/hostname' is not a plain file name"),
                         (f"../ds/{arrow}", "is not a plain file name"), ("x/y/data.arrow", "is not a plain file name"),
                         ("..", "'..' is not a plain file name"), ("pipe.arrow", "this is a FIFO"),
                         ("state.json", "not an .arrow file"), ("gone.arrow", "gone.arrow: named by .* but missing")]:
        state["_data_files"] = [{"filename": name}]
        (ds / "state.json").write_text(json.dumps(state))
        for read in (lambda: open_hf(f"hf:{ds}"), lambda: hf_data_files(f"hf:{ds}")):
            with pytest.raises(UserError, match=reason):
                read()
    (ds / "state.json").write_text(json.dumps({"_data_files": [[]] * 50_000}))
    with pytest.raises(UserError, match="up to 100002 JSON values, over the bound of 50000: refused before parsing"):
        open_hf(f"hf:{ds}")


def test_a_dataset_dict_names_only_plain_split_folders(tmp_path: Path):
    from torchcls.data.hf import hf_splits, open_hf
    root = tmp_path / "dd"
    saved_set(root / "train")
    saved_set(tmp_path / "elsewhere", labels=(0, 1, 2))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../elsewhere"]}))
    for read in (lambda: hf_splits(f"hf:{root}"), lambda: open_hf(f"hf:{root}", "train")):
        with pytest.raises(UserError, match="split '../elsewhere' is not a plain file name"):
            read()
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert hf_splits(f"hf:{root}") == {"train"} and len(open_hf(f"hf:{root}", "train")) == 2


# --- a table's label column asks for no more than MAX_CLASSES classes (review: a 1 KB Parquet with label 10**12
# raised MemoryError making a name per class; 3,000,000 made 3 million class names) -----------------------------

def parquet(path: Path, labels: list, metadata: dict | None = None) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    table = pa.table({"image": [png_bytes()] * len(labels), "label": labels})
    pq.write_table(table.replace_schema_metadata(metadata) if metadata else table, path)
    return path


def test_label_columns_are_bounded_before_a_name_is_made_for_each_class(tmp_path: Path):
    from torchcls.data.hf import open_hf
    cases = [([0, 10**12], "label 1,000,000,000,000, but integer labels are class indexes 0 to 99,999"),
             ([0, 3_000_000], "label 3,000,000, but integer labels are class indexes 0 to 99,999"),
             ([0, -1], "negative labels \\(-1\\)"), ([0, None], "1 empty \\(null\\) labels"),
             (["a", "x" * 2_000], "a class name of 2,000 characters")]
    for labels, reason in cases:
        path = parquet(tmp_path / "l.parquet", labels)
        with address_space(), bounded(seconds=3.0, rss_mb=100), pytest.raises(UserError, match=reason):
            open_hf(f"hf:{path}")
    assert len(open_hf(f"hf:{parquet(tmp_path / 'top.parquet', [0, MAX_CLASSES - 1])}").classes) == MAX_CLASSES
    many = parquet(tmp_path / "s.parquet", [f"c{i}" for i in range(MAX_CLASSES + 1)])
    with bounded(seconds=10.0, rss_mb=300), pytest.raises(UserError, match="100,001 distinct labels, more than"):
        open_hf(f"hf:{many}")
    names = {"info": {"features": {"label": {"_type": "ClassLabel", "names": [str(i) for i in range(MAX_CLASSES + 1)]}}}}
    with pytest.raises(UserError, match="100,001 ClassLabel names, more than the 100,000"):
        open_hf(f"hf:{parquet(tmp_path / 'n.parquet', [0, 1], {'huggingface': json.dumps(names)})}")


# --- CSV manifests (review: one multi-label row listing 15,000 labels made a 229 KB CSV take 2.4 GB) ----------

def write_csv(path: Path, rows: list[tuple[str, str]], column: str = "labels") -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", column])
        w.writerows(rows)
    return path


def test_multilabel_csv_rows_and_matrix_are_bounded_before_allocation(tmp_path: Path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    wide = write_csv(tmp_path / "wide.csv", [("a.png", ";".join(f"c{i}" for i in range(15_000)))] +
                     [("a.png", "c0")] * 15_000)
    with address_space(), bounded(seconds=3.0, rss_mb=100), \
            pytest.raises(UserError, match="line 2 lists 15,000 labels; a row lists at most 1,000"):
        open_source(str(wide), None, "all", 3, "error")
    # 100 rows of 1,000 distinct labels make 100,000 classes; 3,000 rows x 100,000 would be 1.2 GB of float32
    rows = [("a.png", ";".join(f"c{r}_{i}" for i in range(1000))) for r in range(100)] + [("a.png", "c0_0")] * 2_900
    big = write_csv(tmp_path / "big.csv", rows)
    with address_space(), bounded(seconds=10.0, rss_mb=250), \
            pytest.raises(UserError, match="3,000 images x 100,000 labels is 300,000,000 targets, more than 268,435,456"):
        open_source(str(big), None, "all", 3, "error")
    small = open_source(str(write_csv(tmp_path / "ok.csv", [("a.png", "x;y"), ("a.png", "y")])), None, "all", 3, "error")
    assert small.classes == ["x", "y"] and small.targets.tolist() == [[1.0, 1.0], [0.0, 1.0]]


def test_single_label_csv_class_count_and_names_are_bounded(tmp_path: Path):
    many = write_csv(tmp_path / "m.csv", [(f"{i}.png", f"c{i}") for i in range(MAX_CLASSES + 1)], "label")
    with bounded(seconds=10.0, rss_mb=300), pytest.raises(UserError, match="100,001 distinct labels, more than"):
        open_source(str(many), None, "all", 3, "error")
    long = write_csv(tmp_path / "l.csv", [("a.png", "n" * 1_025)], "label")
    with pytest.raises(UserError, match="a class name of 1,025 characters"):
        open_source(str(long), None, "all", 3, "error")
    huge_field = write_csv(tmp_path / "f.csv", [("a.png", "n" * 200_000)], "label")
    with pytest.raises(UserError, match="line 2: not a CSV row \\(field larger than field limit"):
        open_source(str(huge_field), None, "all", 3, "error")


def test_folders_hold_at_most_max_classes_class_folders(tmp_path: Path, monkeypatch):
    from torchcls.data import label_bounds, splits
    assert label_bounds.MAX_CLASSES is MAX_CLASSES  # one bound for data and models
    monkeypatch.setattr(label_bounds, "MAX_CLASSES", 3)  # (100,001 real folders would take the test minutes)
    monkeypatch.setattr(splits, "MAX_CLASSES", 3)
    for i in range(5):
        (tmp_path / "plain" / f"c{i}").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "plain" / f"c{i}" / "a.png")
    with pytest.raises(UserError, match="plain: 4 class folders \\(or more\\), more than the 3 classes"):
        open_source(str(tmp_path / "plain"), None, "train", 3, "error")
    for i in range(8):
        (tmp_path / "split" / "train" / f"c{i}").mkdir(parents=True)
    with pytest.raises(UserError, match="train: 7 entries \\(or more\\) where class folders are expected"):
        open_source(str(tmp_path / "split"), None, "train", 3, "error")


# --- metrics.jsonl is read a bounded line at a time (before: read whole and every line parsed unbounded) --------

def test_metrics_lines_are_bounded_before_they_are_parsed(tmp_path: Path):
    from torchcls.training.rundir import read_metrics
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"kind": "epoch", "val_loss": NaN}\n{"kind": "step", "loss": 1.5}\n{"kind": "ste')
    assert [r["kind"] for r in read_metrics(tmp_path)] == ["epoch", "step"]  # NaN kept, a torn last line dropped
    cases = {"line 2 is longer than 4,194,304 bytes": '{"a": "' + "x" * (5 << 20) + '"}',
             "up to 700002 JSON values, over the bound of 250000": '{"a": [' + ",".join(["[]"] * 350_000) + "]}",
             "line 2 is not a JSON object": "[1, 2]"}
    for reason, line in cases.items():
        log.write_text('{"kind": "step"}\n' + line + "\n")
        with bounded(seconds=3.0, rss_mb=60), pytest.raises(UserError, match=reason):
            read_metrics(tmp_path)
    log.write_text(('{"a": [' + ",".join(["0"] * 200_000) + "]}\n") * 51)
    with pytest.raises(UserError, match="more than 10,000,000 values by line 50: refused before parsing"):
        read_metrics(tmp_path)


# --- shards: the index, a scanned .cls label and each member read are bounded ----------------------------------

def tar_with(path: Path, members: dict[str, bytes | int]) -> Path:
    """A tar whose members hold the given bytes, or (an int) that many bytes of a sparse hole, never written."""
    with path.open("wb") as f:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = data if isinstance(data, int) else len(data)
            f.write(info.tobuf(format=tarfile.USTAR_FORMAT))
            if isinstance(data, int):
                f.seek(-(-data // 512) * 512, os.SEEK_CUR)
            else:
                f.write(data + bytes(-len(data) % 512))
        f.write(bytes(1024))
    return path


def test_shard_classes_and_members_are_bounded(tmp_path: Path):
    from torchcls.data.shards import open_shards
    from torchcls.data.streaming import shard_loader
    (tmp_path / "a").mkdir()
    huge = tar_with(tmp_path / "a" / "s.tar", {"0.png": png_bytes(), "0.cls": b"1000000000000"})
    with address_space(), bounded(), pytest.raises(UserError, match="sample 0: label 1,000,000,000,000, but "):
        open_shards(str(huge))  # (it made a name for each of 10**12 classes)
    (tmp_path / "b").mkdir()
    tar_with(tmp_path / "b" / "s.tar", {"0.png": png_bytes(), "0.cls": b"0"})
    (tmp_path / "b" / "index.json").write_text(json.dumps(
        {"format": "torchcls-webdataset-index", "version": 1, "classes": [str(i) for i in range(MAX_CLASSES + 1)],
         "shards": [{"name": "s.tar", "samples": 1, "bytes": (tmp_path / "b" / "s.tar").stat().st_size}]}))
    with pytest.raises(UserError, match="100,001 classes, more than the 100,000"):
        open_shards(str(tmp_path / "b"))
    (tmp_path / "c").mkdir()  # a 300 MiB image member (a sparse hole): named bad, never read
    sparse = tar_with(tmp_path / "c" / "s.tar", {"0.png": 300 << 20, "0.cls": b"0", "1.png": png_bytes(),
                                                 "1.cls": b"1"})
    shardset = open_shards(str(sparse))
    loader = shard_loader(shardset, 1, 0, seed=0, shuffle=False, on_bad_file="skip")
    with address_space(), bounded(seconds=3.0, rss_mb=60):
        batches = list(loader)
    assert [int(b[1]) for b in batches] == [1]
    assert "larger than an image is read (268,435,456 bytes" in loader.skipped[0][2]


def test_skip_logs_pass_over_what_is_not_a_record(tmp_path: Path):
    from torchcls.data.skips import read_skips
    good = json.dumps({"file": "a.png", "reason": "truncated"})
    (tmp_path / "decode_skips.rank0.jsonl").write_text(
        "\n".join([good, "[]", '{"file": 3}', "x" * 100_000, good, '{"file": "b.png", "reason": "cut']))
    assert read_skips(tmp_path) == [{"file": "a.png", "reason": "truncated", "times": 2}]


def test_a_parquet_file_declaring_more_than_it_may_decode_is_refused_before_reading(tmp_path: Path, monkeypatch):
    """A 13.5 KB zstd Parquet holding one 400 MB cell of zeros cost 1.3 GB when opened (a Parquet set is decoded
    whole). Here the floor is lowered so that a 4 MiB cell stands for it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchcls.data import hf
    path = tmp_path / "z.parquet"
    pq.write_table(pa.table({"image": [bytes(4 << 20)], "label": [0]}), path, compression="zstd")
    assert path.stat().st_size < 4096
    monkeypatch.setattr(hf, "PARQUET_FLOOR", 1 << 20)
    with pytest.raises(UserError, match="its columns decode to 4,194,[0-9,]+ bytes, more than 1,048,576"):
        hf.open_hf(f"hf:{path}")
    monkeypatch.setattr(hf, "PARQUET_FLOOR", 8 << 20)
    assert len(hf.open_hf(f"hf:{path}")) == 1


# --- sizes read from a data input, bounded before they are allocated (review: a 7.6 MiB CSV of ",\n" rows took
# +1.16 GiB; an IDX header of (15, 2048, 2048) made 2048 px images; an HF cell was copied whole before the per-image
# bound). Memory is measured here, never time. ------------------------------------------------------------------

@contextmanager
def peak_rss_growth(limit_mb: float):
    """Fails if this process's peak RSS rises more than `limit_mb` above its RSS at the start of the block (the
    peak is reset first, so earlier tests' peaks hide nothing)."""
    from bounds_check import status_mb
    Path("/proc/self/clear_refs").write_text("5")
    start = status_mb("VmRSS")
    yield
    grew = status_mb("VmHWM") - start
    assert grew < limit_mb, f"peak RSS grew {grew:.0f} MiB"


def test_csv_rows_are_streamed_and_bad_ones_counted_not_kept(tmp_path: Path):
    blank = tmp_path / "blank.csv"
    blank.write_bytes(b"path,label\n" + b",\n" * 1_000_000)  # 2 MB (was ~250 MB of dicts and problem strings)
    with address_space(1.0), peak_rss_growth(40), pytest.raises(UserError) as e:
        open_source(str(blank), None, "train", 3, "error")
    lines = str(e.value).splitlines()
    assert lines[0].endswith("1,000,000 bad row(s):") and lines[1] == "  line 2: empty path or label"
    assert len(lines) == 1 + 20 + 1 and lines[-1] == "  ... and 999,980 more"


def test_csv_row_count_and_row_size_are_bounded_while_reading(tmp_path: Path, monkeypatch):
    from torchcls.data import splits  # (the one CSV reader and its bounds: splits.csv_rows)
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    monkeypatch.setattr(splits, "MAX_CSV_ROWS", 10)
    many = write_csv(tmp_path / "many.csv", [("a.png", "x")] * 11, "label")
    with pytest.raises(UserError, match="many.csv: more than 10 rows \\(torchcls.data.splits.MAX_CSV_ROWS"):
        open_source(str(many), None, "all", 3, "error")
    (tmp_path / "blank.csv").write_text("path,label\n" + "a.png,x\n\n" * 10)  # blank lines are no rows
    assert len(open_source(str(tmp_path / "blank.csv"), None, "all", 3, "error")) == 10
    # One row of 2 million fields (csv bounds a field, not a row): refused before csv splits it.
    wide = tmp_path / "wide.csv"
    wide.write_text("path,label\na.png,x," + "," * (2 << 20) + "\n")
    with address_space(1.0), pytest.raises(UserError, match="wide.csv: line 2: a row of more than 1,048,576 char"):
        open_source(str(wide), None, "all", 3, "error")
    # ... and one row spread over many lines by quoted newlines, each field small
    monkeypatch.setattr(splits, "MAX_CSV_ROW_CHARS", 1_000)
    quoted = tmp_path / "quoted.csv"
    quoted.write_text('path,label\na.png,x,' + '"\n",' * 400 + "\n")
    with pytest.raises(UserError, match="quoted.csv: line [0-9]+: a row of more than 1,000 characters"):
        open_source(str(quoted), None, "all", 3, "error")
    split = write_csv(tmp_path / "split.csv", [("a.png", "x")], "label")  # and a normal manifest still loads
    assert open_source(str(split), None, "all", 3, "error").classes == ["x"]


# --- every read of a CSV manifest goes through one bounded reader (second review: splits.csv_splits, which runs
# first, read with csv.DictReader under the 1 GiB bound only and kept every distinct split value, ~7 bytes held per
# file byte; governance's csv_columns read with no bound at all) -------------------------------------------------

def split_csv(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "split"])
        w.writerows(rows)
    return path


def test_the_split_column_is_read_bounded_and_its_distinct_values_are_few(tmp_path: Path, monkeypatch):
    from torchcls.data import splits
    from torchcls.data.splits import available_splits
    for name in ("a.png", "b.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    rows = [("a.png", "x", "train"), ("b.png", "y", "train"), ("a.png", "x", "val"), ("b.png", "y", "val"),
            ("a.png", "x", "test"), ("b.png", "y", "test")]
    normal = split_csv(tmp_path / "normal.csv", rows)
    assert available_splits(str(normal)) == {"train", "val", "test"}
    assert len(open_source(str(normal), None, "val", 3, "error")) == 2
    # Distinct split values: refused past MAX_CSV_SPLITS as they are read (a million of them were all kept)
    many = split_csv(tmp_path / "many.csv", [("a.png", "x", f"{i:08x}") for i in range(100_000)])
    with peak_rss_growth(40), pytest.raises(UserError, match="many.csv: line 18: its split column holds more than 16 "
                                                              "distinct values .*MAX_CSV_SPLITS"):
        available_splits(str(many))  # (what train, evaluate and the governance commands ask first)
    with peak_rss_growth(40), pytest.raises(UserError, match="many.csv: 100,000 bad row\\(s\\)"):
        open_source(str(many), None, "train", 3, "error")  # (the rows' own read: a bad split is a bad row)
    # ... while a misspelt split is still named by the row check
    valid = split_csv(tmp_path / "valid.csv", rows + [("a.png", "x", "valid")])
    with pytest.raises(UserError, match="line 8: split 'valid' is not one of train, val, test"):
        open_source(str(valid), None, "train", 3, "error")
    # The row count and row size bounds hold for this read too (it runs before the rows are read for a split)
    monkeypatch.setattr(splits, "MAX_CSV_ROWS", 10)
    long = split_csv(tmp_path / "long.csv", rows * 2)
    with pytest.raises(UserError, match="long.csv: more than 10 rows \\(torchcls.data.splits.MAX_CSV_ROWS"):
        available_splits(str(long))
    monkeypatch.setattr(splits, "MAX_CSV_ROW_CHARS", 1_000)
    wide = tmp_path / "wide.csv"
    wide.write_text("path,label,split\na.png,x,train\na.png,x,train" + "," * 2_000 + "\n")
    with pytest.raises(UserError, match="wide.csv: line 3: a row of more than 1,000 characters"):
        available_splits(str(wide))


def test_governance_reads_a_csv_manifest_through_the_same_bounded_reader(tmp_path: Path, monkeypatch):
    from torchcls.data import splits
    from torchcls.governance.manifest import csv_columns
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label,split,tags,jurisdiction\na.png,x,train,faces; minors,DE\n\nb.png,y\n")
    columns = csv_columns(manifest, tmp_path)
    assert columns == {str((tmp_path / "a.png").resolve()): ("x", {"tags": ["faces", "minors"],
                                                                  "dpv:hasJurisdiction": "DE", "split": "train"}),
                       str((tmp_path / "b.png").resolve()): ("y", {})}
    monkeypatch.setattr(splits, "MAX_CSV_ROWS", 10)
    many = write_csv(tmp_path / "many.csv", [("a.png", "x")] * 11, "label")
    with pytest.raises(UserError, match="many.csv: more than 10 rows"):
        csv_columns(many, tmp_path)
    wide = tmp_path / "wide.csv"
    wide.write_text("path,label\na.png,x," + "," * (2 << 20) + "\n")
    with address_space(1.0), pytest.raises(UserError, match="wide.csv: line 2: a row of more than 1,048,576 char"):
        csv_columns(wide, tmp_path)


def idx_gz(path: Path, dims: tuple[int, ...], payload: bytes | None = None, magic: int | None = None) -> Path:
    """A gzipped IDX file: the magic (unsigned bytes, len(dims) dimensions unless given), `dims`, the payload (zeros
    as many as `dims` say unless given)."""
    import gzip
    import math
    import struct
    head = struct.pack(">I", 0x0800 | len(dims) if magic is None else magic) + struct.pack(f">{len(dims)}I", *dims)
    path.write_bytes(gzip.compress(head + (bytes(math.prod(dims)) if payload is None else payload)))
    return path


def test_fashion_mnist_idx_headers_are_checked_against_the_data_set_and_the_payload(tmp_path: Path):
    def fashion(images: Path | None = None, labels: Path | None = None):
        idx_gz(tmp_path / "train-images-idx3-ubyte.gz", (3, 28, 28)) if images is None else None
        idx_gz(tmp_path / "train-labels-idx1-ubyte.gz", (3,), bytes([0, 9, 4])) if labels is None else None
        return open_source("fashion-mnist", str(tmp_path), "train", None, "error")

    good = fashion()
    assert (len(good), good.side, good.targets.tolist()) == (3, 28, [0, 9, 4])
    img, lbl = tmp_path / "train-images-idx3-ubyte.gz", tmp_path / "train-labels-idx1-ubyte.gz"
    cases = [  # (which file, how it is made, what the error says)
        (img, lambda p: idx_gz(p, (15, 2048, 2048), b""), "its header gives the shape 15 x 2048 x 2048; this file "
                                                          "holds N x 28 x 28"),
        (img, lambda p: idx_gz(p, (), b"", magic=0x08FF), "its header has 255 dimension\\(s\\) in 4 bytes"),
        (img, lambda p: idx_gz(p, (3, 28), b""), "its header has 2 dimension\\(s\\)"),
        (img, lambda p: p.write_bytes(__import__("gzip").compress(b"\x00\x00\x08\x03\x00\x00")),
         "its header has 3 dimension\\(s\\) in 6 bytes"),
        (img, lambda p: idx_gz(p, (3, 28, 28), bytes(100)), "shape 3 x 28 x 28, 2,352 bytes, but 100 bytes follow"),
        (img, lambda p: idx_gz(p, (3, 28, 28), bytes(3000)), "2,352 bytes, but 3,000 bytes follow"),
        (img, lambda p: p.write_bytes(idx_gz(p, (3, 28, 28)).read_bytes()[:-20]), "not a readable .gz file"),
        (img, lambda p: p.write_bytes(b"plain"), "not a readable .gz file"),
        (img, lambda p: idx_gz(p, (3, 28, 28), magic=0x0D03), "is not an unsigned-byte IDX file"),
        (lbl, lambda p: idx_gz(p, (3, 1), bytes(3)), "its header has 2 dimension\\(s\\) .* this file holds N;"),
        (lbl, lambda p: idx_gz(p, (2,), bytes(2)), "2 labels; they must be the two files of one split"),
        (lbl, lambda p: idx_gz(p, (3,), bytes([0, 10, 1])), "label 10, but Fashion-MNIST has classes 0 to 9"),
    ]
    for target, make, reason in cases:
        make(target)
        with address_space(1.0), pytest.raises(UserError, match=f"{target.name}.*{reason}"):
            fashion(images=img if target == img else None, labels=lbl if target == lbl else None)


def saved_table(folder: Path, column) -> Path:
    """A save_to_disk folder (as hf_saved reads it) whose image column is `column` and labels 0, 1, ..."""
    import pyarrow as pa
    folder.mkdir()
    table = pa.table({"image": column, "label": pa.array(range(len(column)), pa.int64())})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return folder


@pytest.mark.parametrize("kind", ["binary", "large_binary", "binary_view", "image struct"])
def test_an_hf_cell_is_measured_in_the_table_before_it_is_copied(tmp_path: Path, monkeypatch, kind: str):
    """The bound is lowered to 1 MiB, so a 32 MiB cell stands for a 600 MiB one: it was copied twice (a Scalar,
    then as_py) before the bound refused it."""
    import dataclasses

    import pyarrow as pa

    from torchcls.data import images
    from torchcls.data.hf import open_hf
    monkeypatch.setattr(images, "BOUNDS", dataclasses.replace(images.BOUNDS, max_file_bytes=1 << 20))
    cells = [png_bytes(), bytes(32 << 20), png_bytes()]
    if kind == "image struct":  # datasets' Image feature: {bytes, path}
        column = pa.array([{"bytes": c, "path": None} for c in cells],
                          pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    else:
        column = pa.array(cells, getattr(pa, kind)())
    ds = open_hf(str(saved_table(tmp_path / "ds", column)))
    del column, cells
    assert ds.load(0).shape == (3, 8, 8)
    with peak_rss_growth(16):
        for read in (ds.load, ds.encoded):
            with pytest.raises(BadImage, match="row 1: too large to read: column 'image' holds 33,554,4[0-9]{2} bytes "
                                               "here, .* at most 1,048,576 bytes"):
                read(1)
    assert ds.load(2).shape == (3, 8, 8) and ds.encoded(2)[1] == "png"
