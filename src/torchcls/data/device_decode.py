"""JPEGs decoded where the model trains: `torchvision.io.decode_jpeg` on a list of encoded files, one call
per batch (nvJPEG on CUDA), then the same crops, flips, resizes and normalisation as the per-sample
pipeline, on the decoded images where they are.

The DataLoader workers only read files and draw each sample's augmentation: seeded by its place in
the epoch (data/sampling.py) as the per-sample path is, they run that path's own v2 transforms on a
shape-only stand-in (a tensor on the meta device) and record the parameters each step drew (crop
box, flip). The main process decodes the batch and applies each recorded step with the transform's own
`transform(image, params)`, then ToDtype and Normalize on the whole batch. On a CPU (`--decode device
--device cpu`) the result is identical to the per-sample path, pixel for pixel; on CUDA the decoder
(nvJPEG) and the float resize round differently, by a grey level or so.

Files the GPU decoder would not decode as the per-sample path does go through that path's decoder in
the worker (data/images.decode_bytes) and travel decoded: not JPEG, CMYK, EXIF-rotated, or large enough
to be decoded reduced. A batch whose decode fails is decoded image by image, and the file that fails
follows --on-bad-file like any other.
"""

from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from torchcls.data.images import BadImage, decode_bytes, plan_decode, probe_bytes, read_image_file
from torchcls.data.sampling import EpochSampler
from torchcls.data.sources import ImageSet
from torchcls.data.worker_start import worker_context
from torchcls.errors import UserError

GEOMETRY = (v2.RandomResizedCrop, v2.RandomHorizontalFlip, v2.Resize, v2.CenterCrop, v2.RandomCrop)
EXIF_ORIENTATION = 0x0112


def split_steps(transform: v2.Transform) -> tuple[list[v2.Transform], list[v2.Transform]] | None:
    """(geometric steps, [ToDtype, Normalize]) of a per-sample pipeline, or None when it holds steps this
    path does not replay (augmentation policies, random erasing)."""
    steps = list(getattr(transform, "transforms", []))
    if len(steps) < 2 or not isinstance(steps[-2], v2.ToDtype) or not isinstance(steps[-1], v2.Normalize):
        return None
    geometric = steps[:-2]
    return (geometric, steps[-2:]) if all(isinstance(s, GEOMETRY) for s in geometric) else None


def why_not(ds: Any) -> str | None:
    """Why this dataset (a data.loaders.Transformed) cannot be decoded on the device; None when it can."""
    images = getattr(ds, "images", None)
    if type(images) is not ImageSet:  # governance tensor hooks wrap the set: they run on decoded samples
        return "its samples pass through governance tensor hooks (or are not files)"
    if images.paths is None:
        return f"{images.name} is an in-memory set, not image files"
    if split_steps(ds.transform) is None:
        return "its augmentation (a policy or random erasing) runs per sample; use --augment none/light/flip/standard"
    return None


def jpeg_share(images: ImageSet, sample: int = 256) -> float:
    """The share of JPEG files, from the scan's headers (or the file names)."""
    if images.formats:
        seen = images.formats[:sample]
        return sum(f == "JPEG" for f in seen) / max(1, len(seen))
    seen = (images.paths or [])[:sample]
    return sum(Path(p).suffix.lower() in (".jpg", ".jpeg") for p in seen) / max(1, len(seen))


def decode_on_device(choice: str, ds: Any, device: torch.device) -> bool:
    """--decode: `device` (refused with the reason when the data cannot be), `workers`, or `auto` = on CUDA
    for JPEG files whose augmentation this path replays."""
    if choice == "workers":
        return False
    reason = why_not(ds)
    if choice == "device":
        if reason:
            raise UserError(f"--decode device: {reason}; use --decode workers (or auto)")
        return True
    return device.type == "cuda" and reason is None and jpeg_share(ds.images) >= 0.5


class _ParamLog:
    """A private copy of the geometric steps whose `transform` records (step, params) and passes a
    shape-only stand-in through: running them is drawing the sample's augmentation, nothing else."""

    def __init__(self, steps: list[v2.Transform]):
        self.steps, self.ops = copy.deepcopy(steps), []
        for i, step in enumerate(self.steps):
            step.transform = self._recording(i, step)  # an instance attribute: v2's forward calls it

    def _recording(self, index: int, step: v2.Transform):
        original = type(step).transform

        def transform(inpt: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
            self.ops.append((index, params))
            return original(step, inpt, params)

        return transform

    def draw(self, channels: int, height: int, width: int) -> list[tuple[int, dict[str, Any]]]:
        self.ops = []
        x = torch.empty((channels, height, width), dtype=torch.uint8, device="meta")
        for step in self.steps:
            x = step(x)
        return self.ops


class EncodedSamples(Dataset):
    """The worker side: per sample (kind, payload, ops, target, file), kind "jpeg" (the file's bytes) or
    "pixels" (decoded by the per-sample path's decoder); None for a bad file skipped (--on-bad-file skip)."""

    def __init__(self, ds: Any):
        self.ds, self.channels = ds, ds.images.channels
        self.geometric = split_steps(ds.transform)[0]
        self._log: _ParamLog | None = None  # made in the worker: its closures do not pickle

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_log": None}

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, item: int | tuple[int, int]):
        i, key = item if isinstance(item, tuple) else (item, None)
        if key is not None:  # as Transformed does: the sample's augmentation is a function of its place
            torch.default_generator.manual_seed(key)
        j = int(self.ds.indices[i])
        file = str(self.ds.images.paths[j])
        try:
            kind, payload, (height, width) = self._read(j)
        except BadImage as e:
            return self.ds._bad(file, str(e))
        self._log = self._log or _ParamLog(self.geometric)
        target = self.ds.images.targets[j]
        return kind, payload, self._log.draw(self.channels, height, width), target if target.ndim else int(target), file

    def _read(self, j: int) -> tuple[str, torch.Tensor, tuple[int, int]]:
        images = self.ds.images
        data = read_image_file(images.paths[j])  # a regular file of a bounded size, or BadImage saying why not
        size = _plain_jpeg_size(data)
        if size is not None and plan_decode("JPEG", size[1], size[0], images.min_side, images.max_pixels) == 1:
            return "jpeg", torch.frombuffer(bytearray(data), dtype=torch.uint8), size
        pixels = decode_bytes(data, images.channels, images.min_side, images.max_pixels)  # as images.load(j), read once
        return "pixels", pixels, tuple(pixels.shape[-2:])


def _plain_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a JPEG that decode_jpeg decodes as the per-sample path would (RGB or grey, no EXIF
    rotation); None for anything else, which the per-sample decoder then handles."""
    try:
        if probe_bytes(data).format != "JPEG":  # bounded header reading first, as for every decode
            return None
        with Image.open(io.BytesIO(data), formats=("JPEG",)) as im:
            if im.format != "JPEG" or im.mode not in ("RGB", "L") or im.getexif().get(EXIF_ORIENTATION, 1) != 1:
                return None
            return im.height, im.width
    except Exception:  # unidentifiable, broken header: the per-sample decoder reports it
        return None


def _collate(samples: list) -> list:
    return [s for s in samples if s is not None]  # skipped bad files (--on-bad-file skip)


class DeviceDecodeLoader:
    """The main-process side: iterates like the per-sample DataLoader (same sampler, `reseed` works on it)
    and yields (normalised float images on `device`, targets)."""

    def __init__(self, ds: Any, batch_size: int, workers: int, seed: int, shuffle: bool, rank: int, world: int,
                 device: torch.device):
        self.ds, self.device = ds, device
        self.geometric, self.tail = split_steps(ds.transform)
        self.loader = DataLoader(EncodedSamples(ds), batch_size=batch_size,
                                 sampler=EpochSampler(len(ds), seed, shuffle, rank, world), num_workers=workers,
                                 persistent_workers=workers > 0, drop_last=False, collate_fn=_collate,
                                 multiprocessing_context=worker_context(workers))
        self.sampler, self.batch_size = self.loader.sampler, batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for samples in self.loader:
            yield self.finish(samples)

    def finish(self, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode, replay each sample's geometry, normalise the batch."""
        decoded = self._decode(samples)
        kept = [(img, s) for img, s in zip(decoded, samples) if img is not None]
        if not kept:  # every file of the batch was bad and skipped: an empty batch, as DropBad gives
            return torch.empty(0, *self.ds.sample_shape, device=self.device), torch.empty(0, dtype=torch.long)
        images = []
        for img, (_, _, ops, _, _) in kept:
            for index, params in ops:
                img = self.geometric[index].transform(img, params)
            images.append(img)
        x = torch.stack(images)
        for step in self.tail:  # ToDtype, Normalize: elementwise, so the batch equals the samples stacked
            x = step.transform(x, {})
        targets = [s[3] for _, s in kept]
        y = torch.stack(targets) if isinstance(targets[0], torch.Tensor) else torch.tensor(targets)
        return x, y

    def _decode(self, samples: list) -> list[torch.Tensor | None]:
        jpegs = [i for i, s in enumerate(samples) if s[0] == "jpeg"]
        out: list[torch.Tensor | None] = [s[1].to(self.device) if s[0] == "pixels" else None for s in samples]
        if jpegs:
            try:
                for i, img in zip(jpegs, self._decode_jpegs([samples[i][1] for i in jpegs])):
                    out[i] = img
            except RuntimeError:  # one bad file fails the whole call: find it, decode the rest one by one
                for i in jpegs:
                    out[i] = self._decode_one(samples[i])
        return out

    def _decode_jpegs(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        mode = ImageReadMode.GRAY if self.ds.images.channels == 1 else ImageReadMode.RGB
        with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders (torchcodec); see images.py
            warnings.simplefilter("ignore", DeprecationWarning)
            return decode_jpeg(data, mode=mode, device=self.device)

    def _decode_one(self, sample) -> torch.Tensor | None:
        try:
            return self._decode_jpegs([sample[1]])[0]
        except RuntimeError:
            try:  # the per-sample decoder's verdict: a named bad file, or pixels it can decode
                images = self.ds.images
                return decode_bytes(sample[1].numpy().tobytes(), images.channels, images.min_side,
                                    images.max_pixels).to(self.device)
            except BadImage as e:
                return self.ds._bad(sample[4], str(e))


def device_loader(ds: Any, batch_size: int, workers: int, seed: int, shuffle: bool, rank: int, world: int,
                  device: torch.device) -> DeviceDecodeLoader:
    """The loader over `ds` (a data.loaders.Transformed) that decodes on `device`; same order and augmentation
    draws as data.loaders.make_loader over the same arguments."""
    return DeviceDecodeLoader(ds, batch_size, workers, seed, shuffle, rank, world, device)
