"""JPEGs decoded where the model trains (data/device_decode.py), run here with device = the CPU: the batches
equal the per-sample path's pixel for pixel on real photos (same crop boxes and flips from the same seeds,
same resize and normalisation), including the files it hands to the per-sample decoder (PNG, EXIF-rotated,
grey) and a truncated file skipped by both; a training run gives the same weights either way; --decode
refuses what it cannot replay and auto stays off without CUDA."""

import io
import warnings

import pytest
import torch
from PIL import Image

from conftest import tiny_config
from torchcls.config import DataConfig
from torchcls.data.device_decode import EncodedSamples, decode_on_device, device_loader
from torchcls.data.loaders import build_data, make_loader, reseed
from torchcls.errors import UserError

CPU = torch.device("cpu")


def photo_variants():
    """Real photos (scikit-learn's china.jpg and flower.jpg), cut into 500x375 views."""
    from sklearn.datasets import load_sample_images

    for k, arr in enumerate(load_sample_images().images):
        im = Image.fromarray(arr)
        for i, (left, top) in enumerate(((0, 0), (140, 52), (60, 20))):
            view = im.crop((left, top, left + 500, top + 375))
            yield k, i, view if i != 2 else view.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs") / "photos"
    for k, i, view in photo_variants():
        cls = root / ("china" if k == 0 else "flower")
        cls.mkdir(parents=True, exist_ok=True)
        view.save(cls / f"{i}.jpg", quality=90)
        if i == 0:
            view.convert("L").save(cls / "grey.jpg", quality=85)  # decoded to RGB by both paths
            view.save(cls / "lossless.png")  # not a JPEG: the per-sample decoder, in the worker
            exif = Image.Exif()
            exif[0x0112] = 6  # rotated 90 degrees: the per-sample decoder applies it
            view.save(cls / "rotated.jpg", quality=90, exif=exif)
            buf = io.BytesIO()
            view.save(buf, "JPEG", quality=90)
            (cls / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return root


def batches(loader, epoch):
    reseed(loader, 3, epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "skipped truncated.jpg": the same file in both paths
        return list(loader)


@pytest.mark.parametrize("augment", ["standard", "flip", "none"])
def test_device_path_on_the_cpu_equals_the_per_sample_path(jpeg_folder, augment):
    cfg = DataConfig(source=str(jpeg_folder), img_size=192, augment=augment, val_fraction=0.25, on_bad_file="skip")
    data = build_data(cfg, 0)
    for ds, shuffle in ((data.train, True), (data.val, False)):
        per_sample = make_loader(ds, 4, 0, shuffle=shuffle, seed=3)
        on_device = device_loader(ds, 4, 0, 3, shuffle, 0, 1, CPU)
        for epoch in (0, 1):  # the draws differ between epochs and match within each
            a, b = batches(per_sample, epoch), batches(on_device, epoch)
            assert len(a) == len(b) and sum(len(y) for _, y in a) > 0
            for (xa, ya), (xb, yb) in zip(a, b):
                assert xb.dtype == torch.float32 and xb.shape == xa.shape
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    kinds = {}
    for i in range(len(data.train)):  # most files travel encoded; the odd ones decoded by the per-sample decoder
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sample = EncodedSamples(data.train)[i]
        if sample is not None:
            kinds[sample[4].rsplit("/", 1)[-1]] = sample[0]
    # (at 192 px no JPEG here is large enough to be decoded reduced, which also goes to the per-sample decoder)
    assert {f for f, k in kinds.items() if k == "pixels"} <= {"lossless.png", "rotated.jpg"}
    assert {f for f, k in kinds.items() if k == "jpeg"} >= {"grey.jpg"} and sum(k == "jpeg" for k in kinds.values()) >= 3


def test_a_worker_process_draws_the_same_augmentation(jpeg_folder):
    data = build_data(DataConfig(source=str(jpeg_folder), img_size=192, augment="standard", on_bad_file="skip"), 0)
    a = batches(make_loader(data.train, 4, 1, shuffle=True, seed=5), 0)
    b = batches(device_loader(data.train, 4, 1, 5, True, 0, 1, CPU), 0)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b)) and len(a) == len(b)


def test_decode_choice_refuses_what_it_cannot_replay(jpeg_folder, shapes_dir):
    data = build_data(DataConfig(source=str(jpeg_folder), img_size=192, augment="standard"), 0)
    assert decode_on_device("device", data.train, CPU) is True
    assert decode_on_device("auto", data.train, CPU) is False  # auto: on CUDA only
    assert decode_on_device("workers", data.train, CPU) is False
    policy = build_data(DataConfig(source=str(jpeg_folder), img_size=192, augment="randaugment"), 0)
    with pytest.raises(UserError, match="--decode device: its augmentation .* runs per sample.*--decode workers"):
        decode_on_device("device", policy.train, CPU)
    erasing = build_data(DataConfig(source=str(jpeg_folder), img_size=192, random_erasing=0.5), 0)
    assert decode_on_device("auto", erasing.train, torch.device("cuda")) is False
    pngs = build_data(DataConfig(source=str(shapes_dir), img_size=32), 0)  # PNG files: auto leaves them alone
    assert decode_on_device("auto", pngs.train, torch.device("cuda")) is False
    builtin = build_data(DataConfig(source="mnist-5k"), 0)
    with pytest.raises(UserError, match="in-memory set, not image files"):
        decode_on_device("device", builtin.train, CPU)


def test_training_with_device_decoding_ends_with_the_same_weights(jpeg_folder, tmp_path):
    from safetensors.torch import load_file

    from torchcls.training import train

    weights = {}
    for decode in ("workers", "device"):
        cfg = tiny_config(jpeg_folder, tmp_path / "runs", name=decode, epochs=1)
        cfg.data.decode, cfg.data.augment, cfg.data.in_memory, cfg.data.on_bad_file = decode, "standard", "off", "skip"
        cfg.data.batch_size, cfg.data.val_fraction = 4, 0.25
        result = train(cfg)
        weights[decode] = load_file(result.last_checkpoint)
    assert weights["workers"].keys() == weights["device"].keys()
    assert all(torch.equal(weights["workers"][k], weights["device"][k]) for k in weights["workers"])


def test_an_explicit_device_decode_is_never_left_unused(jpeg_folder, tmp_path):
    """--in-memory auto would cache this small folder and --decode device would never run, without a word."""
    from torchcls.training.distributed import Session
    from torchcls.training.feed import build_feed

    cfg = tiny_config(jpeg_folder, tmp_path)
    cfg.data.decode, cfg.data.on_bad_file, cfg.data.val_fraction = "device", "skip", 0.25
    data = build_data(cfg.data, 0)
    assert build_feed(cfg, data, Session(), CPU).kind == "files"
    cfg.data.in_memory = "on"
    with pytest.raises(UserError, match="--decode device .* --in-memory on"):
        build_feed(cfg, data, Session(), CPU)
