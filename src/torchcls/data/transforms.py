"""Per-sample transforms: uint8 CxHxW tensor -> normalised float tensor, built from torchvision v2.

The presets are library transforms, not hand-written ones: the geometric presets (light, flip,
standard) are v2 crops and flips; randaugment, trivialaugment and autoaugment are torchvision's
policies (they work on 1- and 3-channel uint8 images alike: on a grey image the colour
operations act on its one channel); random erasing is v2.RandomErasing on the normalised image.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision.transforms import v2

from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError

# flip-alternate mirrors by (sample, epoch), which only the in-memory loader knows (data/inmemory.py):
# its per-sample pipeline here has the shifts alone, and training/feed.py refuses it any other feed.
GEOMETRIC = ("none", "light", "flip", "flip-alternate", "standard")
# Policies searched or randomised over the ImageNet op set; they run on uint8 before ToDtype,
# where their integer magnitudes (posterize bits, solarize threshold) are defined.
POLICIES: dict[str, Callable[[], v2.Transform]] = {
    "randaugment": v2.RandAugment,  # 2 ops a sample, magnitude 9 of 31 (the paper's ImageNet setting)
    "trivialaugment": v2.TrivialAugmentWide,  # 1 op, random magnitude: no hyper-parameter to tune
    "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
}
AUGMENTS = GEOMETRIC + tuple(POLICIES)


def check_probability(value: float, flag: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{flag} must be a probability in [0, 1], got {value}")
    return value


def check_augment(augment: str) -> str:
    if augment not in AUGMENTS:
        raise UserError(f"--augment must be one of {', '.join(AUGMENTS)}, got {augment!r}")
    return augment


def shift_pixels(size: int, max_shift: int | None) -> int:
    """The largest shift of the light and flip presets: `max_shift` (--max-shift), else an eighth of the side."""
    if max_shift is None:
        return max(1, size // 8)
    if not 0 <= max_shift < size:
        raise UserError(f"--max-shift must be between 0 and {size - 1} pixels for {size} px inputs, got {max_shift}")
    return max_shift


def build_transform(pre: Preprocess, train: bool, augment: str = "none", source_size: int | None = None,
                    random_erasing: float = 0.0, max_shift: int | None = None) -> v2.Transform:
    """uint8 CxHxW tensor -> normalised float tensor of shape (channels, img_size, img_size).

    `source_size`: the side of every input when known to be square and fixed (built-in
    sets); resizing is then skipped when it would be a no-op (it costs more than the
    rest of the pipeline on 28x28 digits). `augment`, `max_shift` and `random_erasing` apply
    only when `train` is true.
    """
    check_augment(augment)
    check_probability(random_erasing, "--random-erasing")
    size = pre.img_size
    shift = shift_pixels(size, max_shift)
    mode = v2.InterpolationMode(pre.interpolation)
    steps: list[v2.Transform] = []
    if train and augment == "standard":
        steps += [v2.RandomResizedCrop(size, scale=(0.35, 1.0), interpolation=mode, antialias=True),
                  v2.RandomHorizontalFlip()]
    else:
        steps += resize_and_crop(pre, source_size)
        if train and augment in ("light", "flip", "flip-alternate") and shift:
            # Small translations: safe for digits and text, where flips and big crops are not.
            steps.append(v2.RandomCrop(size, padding=shift))
        if train and augment == "flip":  # for left-right symmetric classes (clothes, objects)
            steps.append(v2.RandomHorizontalFlip())
        if train and augment in POLICIES:  # the policies bring their own shifts, rotations and shears
            steps.append(POLICIES[augment]())
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(pre.mean, pre.std)]
    if train and random_erasing > 0:
        # After Normalize, as timm and the paper do: the erased box becomes 0, the data's mean colour.
        steps.append(v2.RandomErasing(p=random_erasing))
    return v2.Compose(steps)


def resize_and_crop(pre: Preprocess, source_size: int | None = None) -> list[v2.Transform]:
    """The evaluation geometry: the short side to `pre.resize_size`, then the centre `img_size` crop
    (timm's eval transform); the steps that would be no-ops on square `source_size` inputs are left out."""
    steps: list[v2.Transform] = []
    if source_size != pre.resize_size:
        steps.append(v2.Resize(pre.resize_size, interpolation=v2.InterpolationMode(pre.interpolation),
                               antialias=True))
    if source_size is None or pre.resize_size != pre.img_size:  # a square input is now resize_size wide
        steps.append(v2.CenterCrop(pre.img_size))
    return steps


def batch_augmentable(augment: str, random_erasing: float = 0.0) -> bool:
    """Whether the in-memory loader's whole-batch augmentation implements this choice.

    The library policies and random erasing draw per-sample operations, so they run in the
    per-sample (map-style) path."""
    return augment in GEOMETRIC and random_erasing == 0.0
