"""The in-memory batched loader: same order and normalisation as the map-style path, seeded
augmentation that really happens, exact mid-epoch resume without replay, rank sharding."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pytest
import torch

from conftest import make_image_folder
from torchcls.config import DataConfig
from torchcls.data import build_data, make_loader
from torchcls.data.batch_augment import resized_crop_flip, shift_flip
from torchcls.data.inmemory import (
    InMemoryLoader,
    build_cache,
    bundle_loaders,
    memory_loaders,
    use_in_memory,
)
from torchcls.data.loaders import Preprocess, reseed
from torchcls.data.sources import open_source
from torchcls.errors import UserError

PRE = Preprocess(28, 1, (0.1307,), (0.3081,))


@pytest.fixture(scope="module")
def mnist():
    cfg = DataConfig()
    cfg.source, cfg.workers, cfg.augment = "mnist-5k", 0, "none"
    return build_data(cfg, seed=0)


@pytest.fixture(scope="module")
def digits(mnist) -> torch.Tensor:
    """The first 600 mnist-5k digits as a (N, 1, 28, 28) uint8 cache."""
    return mnist.images.images[:600].unsqueeze(1).contiguous()


def loader(cache, augment="light", seed=0, batch=32, rank=0, world=1, n=None, train=True) -> InMemoryLoader:
    ids = torch.arange(len(cache) if n is None else n)  # targets = row ids: each sample is identifiable
    return InMemoryLoader(cache[: len(ids)], ids, PRE, batch, train=train, augment=augment, seed=seed,
                          rank=rank, world=world)


def batches(ld, limit=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for xy in ld:
        out.append(xy)
        if limit is not None and len(out) == limit:
            break
    return out


def test_same_batches_as_the_map_style_loader_without_augmentation(mnist):
    """Order (DataLoader + reseed) and normalisation (ToDtype + Normalize) agree, epoch after epoch."""
    train, _, bad = memory_loaders(mnist.images, mnist.preprocess, mnist.train.indices, mnist.val.indices,
                                   64, "none", seed=3)
    assert not bad
    ref = make_loader(mnist.train, 64, 0, shuffle=True, seed=3)
    assert len(train) == len(ref)
    for epoch in (0, 1):
        reseed(ref, 3, epoch)
        train.set_epoch(epoch)
        pairs = list(itertools.islice(zip(ref, train), 12))  # the order is one permutation: 12 batches show it
        for (xa, ya), (xb, yb) in pairs:
            assert torch.equal(ya, yb)
            torch.testing.assert_close(xb, xa, atol=1e-5, rtol=0)


@pytest.mark.parametrize("augment", ["none", "light", "flip", "standard"])
def test_each_preset_shape_dtype_range_and_determinism(digits, augment):
    a, b = batches(loader(digits, augment, seed=5)), batches(loader(digits, augment, seed=5))
    lo, hi = (0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081
    assert len(a) == len(b) == 600 // 32 + 1
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.dtype == torch.float32 and ya.dtype == torch.int64
        assert xa.shape[1:] == (1, 28, 28) and len(xa) == len(ya)
        assert xa.min() >= lo - 1e-5 and xa.max() <= hi + 1e-5
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert sorted(torch.cat([y for _, y in a]).tolist()) == list(range(600))  # each sample once an epoch
    other = batches(loader(digits, augment, seed=6), limit=1)[0]
    assert not torch.equal(other[1], a[0][1])  # another seed, another order


def _unaugmented(digits):
    """The first batch without augmentation: the order is drawn before any augmentation parameter."""
    return batches(loader(digits, "none"), limit=1)[0]


def _shifts(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Every (2p+1)^2 zero-filled shift of one (C, H, W) image: (K, C, H, W)."""
    h, w = x.shape[-2:]
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad), value=float(x.min()))
    return torch.stack([padded[:, i:i + h, j:j + w] for i in range(2 * pad + 1) for j in range(2 * pad + 1)])


@pytest.mark.parametrize("augment", ["light", "flip"])
def test_shifts_and_flips_happen_within_their_range(digits, augment):
    (x, y), (x0, y0) = batches(loader(digits, augment), limit=1)[0], _unaugmented(digits)
    assert torch.equal(y, y0)
    flipped = 0
    for img, ref in zip(x, x0):
        candidates = _shifts(ref, 28 // 8)  # padding = size // 8, as RandomCrop(padding=) in the map-style path
        plain = (candidates == img).flatten(1).all(1).any().item()
        mirrored = (candidates.flip(-1) == img).flatten(1).all(1).any().item()
        assert plain or mirrored
        flipped += mirrored and not plain
    changed = (x != x0).flatten(1).any(1).float().mean().item()
    assert changed > 0.7  # a zero shift (1 in 49) and no flip leaves an image as it was
    if augment == "flip":
        assert 4 <= flipped <= 28  # about half of 32
    else:
        assert flipped == 0


def test_max_shift_bounds_the_shifts_and_zero_leaves_mirrors_only(digits):
    x0, _ = _unaugmented(digits)
    for max_shift in (1, 0):
        ld = InMemoryLoader(digits, torch.arange(len(digits)), PRE, 32, train=True, augment="flip", max_shift=max_shift)
        (x, _), = batches(ld, limit=1)
        flipped = 0
        for img, ref in zip(x, x0):
            candidates = _shifts(ref, max_shift)
            plain = (candidates == img).flatten(1).all(1).any().item()
            mirrored = (candidates.flip(-1) == img).flatten(1).all(1).any().item()
            assert plain or mirrored
            flipped += mirrored and not plain
        assert 4 <= flipped <= 28
    assert torch.equal(torch.where(x == x0, x0, x0.flip(-1)), x)  # 0: each image is itself or its mirror


def test_standard_crops_zoom_and_flip(digits):
    (x, _), (x0, _) = batches(loader(digits, "standard"), limit=1)[0], _unaugmented(digits)
    assert (x - x0).abs().flatten(1).amax(1).min() > 0  # every image resampled
    full = torch.tensor([[0.0, 0.0, 28.0, 28.0]] * 2)
    u = x0[:2] * 0.3081 + 0.1307
    same = dict(atol=1e-5, rtol=0)
    torch.testing.assert_close(resized_crop_flip(u, full, torch.tensor([False, False])), u, **same)  # identity
    torch.testing.assert_close(resized_crop_flip(u, full, torch.tensor([True, True])), u.flip(-1), **same)


def test_shift_flip_moves_pixels_by_the_drawn_offsets():
    img = torch.arange(16, dtype=torch.uint8).view(1, 1, 4, 4)
    out = shift_flip(img, torch.tensor([[2, 1]]), None, pad=1)  # crop at (2, 1) of the padded image: down-shift -1
    assert out[0, 0].tolist() == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [0, 0, 0, 0]]
    flipped = shift_flip(img, torch.tensor([[1, 1]]), torch.tensor([True]), pad=1)
    assert torch.equal(flipped, img.flip(-1))


@pytest.mark.parametrize("augment", ["flip", "standard"])
def test_exact_resume_mid_epoch_without_replay(digits, augment, tmp_path: Path):
    full = loader(digits, augment, seed=1)
    full.set_epoch(2)
    expected = batches(full)
    first = loader(digits, augment, seed=1)
    first.set_epoch(2)
    it = iter(first)
    for _ in range(5):
        next(it)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # what a checkpoint stores; loads with weights_only
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert state["epoch"] == 2 and state["position"] == 5

    resumed = loader(digits, augment, seed=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # what the trainer calls at the start of the resumed epoch: keeps the position
    rest = batches(resumed)
    assert len(rest) == len(expected) - 5  # the first five are not produced again
    for (xa, ya), (xb, yb) in zip(expected[5:], rest):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert resumed.state_dict()["epoch"] == 3 and resumed.state_dict()["position"] == 0


@pytest.mark.parametrize("augment", ["light", "standard"])
def test_seek_resumes_from_the_epoch_and_step_alone(digits, augment):
    full = loader(digits, augment, seed=4, n=590)  # 590 = 18 full batches of 32 and one of 14
    full.set_epoch(1)
    expected = batches(full)
    resumed = loader(digits, augment, seed=4, n=590)
    resumed.set_epoch(1)
    resumed.seek(7)
    rest = batches(resumed)
    assert len(rest) == len(expected) - 7
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected[7:], rest))
    resumed.set_epoch(1)
    resumed.seek(len(expected) - 1)  # the short last batch
    assert torch.equal(batches(resumed)[0][0], expected[-1][0])
    with pytest.raises(UserError, match="outside this epoch's"):  # (a received run dir's step: a user's error)
        resumed.seek(len(expected) + 1)


def test_a_completed_epoch_reshuffles_and_set_epoch_repeats_it(digits):
    ld = loader(digits, "light")
    e0, e1 = batches(ld), batches(ld)
    assert not torch.equal(e0[0][1], e1[0][1])
    ld.set_epoch(0)
    assert torch.equal(batches(ld, limit=1)[0][0], e0[0][0])


@pytest.mark.parametrize("n,world", [(600, 3), (599, 4)])
def test_ranks_share_every_global_batch_exactly(digits, n, world):
    """Rank r takes positions r, r+W, ... of the one-process global batch, with the same augmentation.

    A world size that does not divide n pads the order by wrapping around (as the sharded
    samplers do), so only then does the last global batch differ from one process's."""
    single = batches(loader(digits, "flip", batch=24, n=n))
    ranks = [batches(loader(digits, "flip", batch=24, n=n, rank=r, world=world)) for r in range(world)]
    padded = -(-n // world) * world
    assert all(len(r) == len(single) == -(-padded // 24) for r in ranks)
    seen = torch.cat([y for r in ranks for _, y in r])
    assert len(seen) == padded and set(seen.tolist()) == set(range(n))
    assert torch.bincount(seen).max() <= 2 and (torch.bincount(seen) == 2).sum() == padded - n  # wrap-around pad
    for k, (x, y) in enumerate(single[: len(single) - (n % world > 0)]):
        for r in range(world):
            xr, yr = ranks[r][k]
            assert torch.equal(yr, y[r::world]) and torch.equal(xr, x[r::world])


def test_validation_order_is_sequential_and_unaugmented(digits):
    ld = loader(digits, "standard", train=False, batch=100)
    x, y = batches(ld, limit=1)[0]
    assert y.tolist() == list(range(100))
    torch.testing.assert_close(x, (digits[:100].float() / 255 - 0.1307) / 0.3081, atol=1e-5, rtol=0)


def test_file_cache_matches_the_eval_transform_and_reports_bad_files(tmp_path: Path):
    root = make_image_folder(tmp_path / "shapes", per_class=6, size=24)
    images = open_source(str(root), None, "train", 3, "error")
    pre = Preprocess(32, 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    cfg = DataConfig()
    cfg.source, cfg.img_size, cfg.workers, cfg.val_fraction = str(root), 32, 0, 0.5
    ref = build_data(cfg, seed=0)
    _, val, _ = memory_loaders(images, pre, ref.train.indices, ref.val.indices, 4, "none", seed=0)
    got = torch.cat([x for x, _ in val])
    want = torch.stack([ref.val[i][0] for i in range(len(ref.val))])
    assert got.shape == (len(ref.val), 3, 32, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    images.paths[0].write_bytes(b"not an image")  # broken after the scan: found when caching
    with pytest.raises(UserError, match="--on-bad-file skip"):
        memory_loaders(images, pre, ref.train.indices, ref.val.indices, 4, "none", seed=0)
    train, val, bad = memory_loaders(images, pre, ref.train.indices, ref.val.indices, 4, "none", seed=0,
                                     on_bad_file="skip")
    assert [f for f, _ in bad] == [str(images.paths[0])]
    assert train.n + val.n == len(images) - 1


def test_grey_set_as_rgb_at_another_size(mnist):
    pre = Preprocess(32, 3, (0.1307,) * 3, (0.3081,) * 3)
    cache, _ = build_cache(mnist.images, pre)
    assert cache.shape == (len(mnist.images), 1, 32, 32)  # stored once, expanded per batch
    x, _ = batches(InMemoryLoader(cache, mnist.images.targets, pre, 16, train=True, augment="flip"), limit=1)[0]
    assert x.shape == (16, 3, 32, 32) and torch.equal(x[:, 0], x[:, 2])


def test_refusals_name_the_option(mnist, digits):
    with pytest.raises(UserError, match="--batch-size 30 must be a multiple of the world size 4"):
        loader(digits, batch=30, world=4)
    with pytest.raises(UserError, match="--augment"):
        loader(digits, augment="heavy")
    with pytest.raises(UserError, match="--memory-limit-mb"):
        use_in_memory("on", 1, mnist.images, mnist.preprocess)
    assert use_in_memory("auto", 4096, mnist.images, mnist.preprocess)
    assert not use_in_memory("auto", 1, mnist.images, mnist.preprocess)
    assert not use_in_memory("off", 4096, mnist.images, mnist.preprocess)
    with pytest.raises(UserError, match="same data and --batch-size"):
        loader(digits, batch=16).load_state_dict(loader(digits, batch=32).state_dict())


def test_bundle_loaders_follow_the_data_config(mnist):
    cfg = DataConfig()
    cfg.batch_size, cfg.augment, cfg.in_memory, cfg.memory_limit_mb = 64, "flip", "off", 4096
    assert bundle_loaders(mnist, cfg, seed=0) is None
    cfg.in_memory = "auto"
    train, val, bad = bundle_loaders(mnist, cfg, seed=0, val_batch_size=256)
    assert not bad and (train.n, val.n) == (len(mnist.train), len(mnist.val))
    assert len(train) == -(-len(mnist.train) // 64) and train.augment == "flip" and val.augment == "none"
    assert train.max_shift == 3  # an eighth of 28 px
    cfg.max_shift = 1
    assert bundle_loaders(mnist, cfg, seed=0)[0].max_shift == 1
    x, y = next(iter(val))
    assert x.shape == (256, 1, 28, 28) and torch.equal(y, mnist.images.targets[mnist.val.indices[:256]])
    cfg.in_memory, cfg.memory_limit_mb = "on", 1
    with pytest.raises(UserError, match="--memory-limit-mb 1"):
        bundle_loaders(mnist, cfg, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("augment", ["flip", "standard"])
def test_augmentation_on_the_gpu_matches_the_cpu(digits, augment):
    """The parameters come from the CPU generator; only the tensor ops run on the device."""
    cpu = batches(loader(digits, augment), limit=3)
    gpu = InMemoryLoader(digits, torch.arange(len(digits)), PRE, 32, train=True, augment=augment, device="cuda")
    for (xc, yc), (xg, yg) in zip(cpu, batches(gpu, limit=3)):
        assert xg.device.type == "cuda" and torch.equal(yg.cpu(), yc)
        torch.testing.assert_close(xg.cpu(), xc, atol=1e-4, rtol=0)


def test_random_resized_crops_of_small_images_crop_the_originals(tmp_path: Path):
    """24 px files at --img-size 32: the training cache keeps them at 24 px and each crop is resized once to 32,
    as the map-style RandomResizedCrop does (a 32 px cache made every crop interpolate twice: 0.5 points of
    top-1 on Fashion-MNIST); validation still sees the eval geometry. Same-size or larger images, and the
    other presets, keep the cache at the input size."""
    from torchcls.data.inmemory import train_side

    root = make_image_folder(tmp_path / "shapes", per_class=6, size=24)
    images = open_source(str(root), None, "train", 3, "error")
    pre = Preprocess(32, 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert (train_side(images, pre, "standard"), train_side(images, pre, "flip")) == (24, 32)
    assert train_side(images, Preprocess(24, 3, pre.mean, pre.std), "standard") == 24  # no resize either way
    cfg = DataConfig()
    cfg.source, cfg.img_size, cfg.workers, cfg.val_fraction = str(root), 32, 0, 0.5
    ref = build_data(cfg, seed=0)
    train, val, _ = memory_loaders(images, pre, ref.train.indices, ref.val.indices, 4, "standard", seed=0)
    assert train.cache.shape[-2:] == (24, 24) and val.cache.shape[-2:] == (32, 32)
    x, _ = batches(train, limit=1)[0]
    assert x.shape == (4, 3, 32, 32)
    got = torch.cat([x for x, _ in val])  # validation: identical to the map-style eval transform
    want = torch.stack([ref.val[i][0] for i in range(len(ref.val))])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the whole image as the box, no flip: one bilinear resize of the original to 32 px
    u8 = train.cache[:2].float()
    whole = resized_crop_flip(u8, torch.tensor([[0.0, 0.0, 24.0, 24.0]] * 2), torch.tensor([False, False]), 32)
    resized = torch.nn.functional.interpolate(u8, size=(32, 32), mode="bilinear", align_corners=False)
    torch.testing.assert_close(whole, resized, atol=1e-3, rtol=0)
