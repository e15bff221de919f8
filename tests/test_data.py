import csv
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import FASHION_DIR
from torchcls.config import DataConfig
from torchcls.data import build_data, open_source
from torchcls.data.loaders import make_loader, reseed, stratified_split
from torchcls.errors import UserError


def test_mnist_5k_is_the_real_set():
    s = open_source("mnist-5k", None, "train", None, "error")
    assert s.images.shape == (5000, 28, 28) and s.images.dtype == torch.uint8
    assert torch.bincount(s.targets).tolist() == [500] * 10
    assert s.classes == [str(d) for d in range(10)] and s.channels == 1
    assert 30 < s.images.float().mean() < 40  # MNIST's mean intensity is ~33/255·255


@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="needs the Debian package dataset-fashion-mnist "
                    "(make test installs it when run as root)")
def test_fashion_mnist_official_splits():
    train = open_source("fashion-mnist", None, "train", None, "error")
    test = open_source("fashion-mnist", None, "test", None, "error")
    assert train.images.shape == (60000, 28, 28) and test.images.shape == (10000, 28, 28)
    assert torch.bincount(test.targets).tolist() == [1000] * 10 and train.classes[9] == "Ankle boot"


def test_fashion_mnist_missing_dir_says_how_to_get_it(tmp_path):
    with pytest.raises(UserError, match="apt-get install dataset-fashion-mnist"):
        open_source("fashion-mnist", str(tmp_path), "train", None, "error")


def test_split_is_seeded_stratified_and_disjoint():
    targets = torch.arange(100) % 4
    a_train, a_val = stratified_split(targets, 0.2, seed=3)
    b_train, b_val = stratified_split(targets, 0.2, seed=3)
    _, c_val = stratified_split(targets, 0.2, seed=4)
    assert torch.equal(a_val, b_val) and not torch.equal(a_val, c_val)
    assert len(a_val) == 20 and set(a_train.tolist()).isdisjoint(a_val.tolist())
    assert torch.bincount(targets[a_val]).tolist() == [5, 5, 5, 5]


def test_image_folder_and_transforms(shapes_dir):
    bundle = build_data(DataConfig(source=str(shapes_dir), img_size=24, workers=0), seed=0)
    assert bundle.classes == ["circle", "square"] and len(bundle.train) + len(bundle.val) == 32
    x, y = bundle.train[0]
    assert x.shape == (3, 24, 24) and x.dtype == torch.float32 and y in (0, 1)
    grey = build_data(DataConfig(source=str(shapes_dir), channels=1, workers=0), seed=0)
    assert grey.train[0][0].shape == (1, 224, 224)


def test_builtin_grey_set_as_rgb():
    bundle = build_data(DataConfig(source="mnist-5k", channels=3, img_size=32), seed=0)
    x, _ = bundle.val[0]
    assert x.shape == (3, 32, 32) and torch.allclose(x[0], x[1])


def test_data_order_depends_only_on_seed_and_epoch(shapes_dir):
    bundle = build_data(DataConfig(source=str(shapes_dir), workers=0, img_size=16), seed=0)
    loader = make_loader(bundle.train, 4, 0, shuffle=True)

    def first_epoch_batch(epoch):
        reseed(loader, 7, epoch)
        return next(iter(loader))[0]

    e0 = first_epoch_batch(0)
    first_epoch_batch(1)
    assert torch.equal(first_epoch_batch(0), e0) and not torch.equal(first_epoch_batch(1), e0)



def test_map_style_loader_starts_mid_epoch_without_replay_and_keeps_its_workers(shapes_dir):
    """Every sample's augmentation is seeded by its place in the order: starting a pass at position 8
    gives exactly the rest of the full pass, in the same persistent workers or in a new loader."""
    bundle = build_data(DataConfig(source=str(shapes_dir), img_size=16, augment="standard"), seed=0)
    loader = make_loader(bundle.train, 4, workers=2, shuffle=True, seed=5)
    reseed(loader, 5, 1)
    full = [x for x, _ in loader]
    workers = loader._iterator
    reseed(loader, 5, 1, start=8)
    rest = [x for x, _ in loader]
    assert loader._iterator is workers  # persistent: no re-fork per pass
    assert len(rest) == len(full) - 2 and all(torch.equal(a, b) for a, b in zip(full[2:], rest))
    fresh = make_loader(bundle.train, 4, workers=1, shuffle=True, seed=5)  # another worker count, new process
    reseed(fresh, 5, 1, start=8)
    assert all(torch.equal(a, b) for a, b in zip(rest, (x for x, _ in fresh)))
    reseed(loader, 5, 2)
    assert not torch.equal(next(iter(loader))[0], full[0])  # a new epoch: new order and augmentation

def test_csv_manifest(tmp_path, shapes_dir):
    manifest = tmp_path / "m.csv"
    files = sorted(shapes_dir.rglob("*.png"))
    with manifest.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label"])
        for p in files:
            w.writerow([p.relative_to(shapes_dir), p.parent.name])
    s = open_source(str(manifest), str(shapes_dir), "train", None, "error")
    assert s.classes == ["circle", "square"] and len(s) == len(files)


def test_csv_missing_files_error_or_skip(tmp_path, shapes_dir):
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label\ncircle/circle_000.png,circle\nnope.png,square\nsquare/square_000.png,square\n")
    with pytest.raises(UserError, match=r"(?s)1 unreadable image file\(s\).*listed on line 3 of m\.csv but missing") as e:
        open_source(str(manifest), str(shapes_dir), "train", None, "error")
    assert "nope.png" in str(e.value)
    s = open_source(str(manifest), str(shapes_dir), "train", None, "skip")
    assert len(s) == 2 and s.skipped[0][0].endswith("nope.png")


def test_csv_bad_header_and_empty_label(tmp_path):
    (tmp_path / "h.csv").write_text("file,class\na.png,x\n")
    with pytest.raises(UserError, match="'path' and 'label'"):
        open_source(str(tmp_path / "h.csv"), None, "train", None, "error")
    (tmp_path / "e.csv").write_text("path,label\na.png,\n")
    with pytest.raises(UserError, match="line 2: empty path or label"):
        open_source(str(tmp_path / "e.csv"), None, "train", None, "error")


def test_bad_files_in_folder_error_lists_them_and_skip_counts_them(shapes_dir):
    (shapes_dir / "circle" / "zero.png").write_bytes(b"")
    (shapes_dir / "square" / "notes.txt").write_text("hello")
    Image.new("CMYK", (32, 32)).save(shapes_dir / "square" / "cmyk.jpg")  # fine: converted
    with pytest.raises(UserError, match="2 unreadable image file") as e:
        open_source(str(shapes_dir), None, "train", None, "error")
    assert "zero.png: empty file" in str(e.value) and "notes.txt: not an image" in str(e.value)
    s = open_source(str(shapes_dir), None, "train", None, "skip")
    assert len(s) == 33 and sorted(Path(f).name for f, _ in s.skipped) == ["notes.txt", "zero.png"]


@pytest.mark.parametrize("layout, message", [
    ("missing", "not a built-in data set"),
    ("no_classes", "no class folders"),
    ("empty_class", "class folder .* is empty"),
    ("one_class", "classification needs at least 2"),
])
def test_bad_data_dirs(tmp_path, shapes_dir, layout, message):
    root = tmp_path / "d"
    if layout == "no_classes":
        root.mkdir()
    elif layout == "empty_class":
        root = shapes_dir
        (root / "triangle").mkdir()
    elif layout == "one_class":
        root = shapes_dir
        for f in (root / "square").iterdir():
            f.unlink()
        (root / "square").rmdir()
    with pytest.raises(UserError, match=message):
        build_data(DataConfig(source=str(root), workers=0), seed=0)


def test_epoch_sampler_ranks_cover_the_order_with_the_same_keys():
    from torchcls.data.sampling import EpochSampler

    one = EpochSampler(10, seed=3, shuffle=True)
    one.set_epoch(2)
    single = list(one)
    ranks = []
    for r in range(3):
        s = EpochSampler(10, seed=3, shuffle=True, rank=r, world=3)
        s.set_epoch(2)
        ranks.append(list(s))
    assert all(len(share) == 4 for share in ranks)  # 10 padded to 12: every rank runs as many steps
    merged = [ranks[pos % 3][pos // 3] for pos in range(12)]
    assert merged[:10] == single  # (index, augmentation key) pairs: the same whatever the world size
    assert [i for i, _ in merged[10:]] == [i for i, _ in single[:2]]  # the wrap-around padding
    s = EpochSampler(10, seed=3, shuffle=True, rank=1, world=3)
    s.set_epoch(2, start=2)
    assert list(s) == ranks[1][2:]
