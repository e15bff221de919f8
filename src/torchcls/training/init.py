"""--init: initialisations applied from outside the model, on top of its own random init.

whiten (airbench, arXiv 2404.00498): the first convolution's filters become the eigenvectors of the
training images' patch second-moment matrix, each over sqrt(eigenvalue + eps), so its outputs on those
patches are decorrelated with unit variance (exactly: their second-moment matrix is diag(l / (l + eps)));
each filter is also stored negated, so a ReLU after it keeps both signs: 2 x c x kh x kw filters. A
convolution with fewer out-channels takes the top out // 2 eigenvectors (largest eigenvalue first); one
with more keeps its own init in the rest. Like airbench, the matrix is not mean-centred (the patch mean
is one more direction to whiten), and the patches come from up to WHITEN_IMAGES training images, seeded,
in the evaluation geometry (no augmentation), at most MAX_PATCHES patches (a larger stride when more).

dirac (airbench): every later stride-1 "same" convolution starts as the identity on its first
min(in, out) output channels (torch.nn.init.dirac_ on those filters), the rest of its filters keeping
their init: a deep net starts close to a shallow one.

freeze_first_conv and FirstBiasFreeze (--freeze-first-bias-after-epochs) stop training the first layer's
weight (from the start) and bias (after N epochs), as airbench trains its whitening bias for a few epochs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from torchcls.data.images import BadImage
from torchcls.data.transforms import build_transform
from torchcls.errors import UserError
from torchcls.models.parts import unwrap

METHODS = ("whiten", "dirac")
WHITEN_IMAGES = 2000  # airbench takes 5,000 CIFAR images; the eigenvectors of 9 to 27 dims settle long before
MAX_PATCHES = 1 << 21  # 2M patches (2,000 28-px images at stride 1): bounds the time and memory of the moments
CHUNK_VALUES = 1 << 24  # patch values unfolded at a time (64 MB of float32)
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def parse_init(spec: str) -> tuple[str, ...]:
    """The methods --init names ('' = none), refused with the valid ones when one is unknown."""
    methods = tuple(m.strip() for m in spec.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"--init {spec!r}: unknown {', '.join(map(repr, unknown))}; give a comma-separated list of "
                        f"{', '.join(METHODS)} (e.g. --init whiten,dirac), or leave it empty")
    return methods


def first_conv(net: nn.Module) -> tuple[str, nn.Conv2d]:
    """The first Conv2d in the model's module order (its stem): the layer that reads the image."""
    for name, module in unwrap(net).named_modules():
        if isinstance(module, nn.Conv2d):
            return name, module
    raise UserError(f"{type(unwrap(net)).__name__} has no Conv2d: --init whiten, --freeze-first-conv and "
                    "--freeze-first-bias-after-epochs need a model whose first layer is a convolution")


def first_bias(net: nn.Module) -> tuple[str, nn.Parameter]:
    """The first layer's bias: the first convolution's, or when it has none (conv -> BatchNorm) the bias of the
    first BatchNorm after it in module order that normalises its out-channels."""
    name, conv = first_conv(net)
    if conv.bias is not None:
        return f"{name}.bias", conv.bias
    after = False
    for n, module in unwrap(net).named_modules():
        after = after or module is conv
        if after and isinstance(module, BATCHNORMS) and module.num_features == conv.out_channels \
                and module.bias is not None:
            return f"{n}.bias", module.bias
    raise UserError(f"--freeze-first-bias-after-epochs: the first convolution ({name}) has no bias and no "
                    "BatchNorm with a bias follows it; leave the option at 0 for this model")


def initialise(model: nn.Module, methods: tuple[str, ...], data, seed: int, eps: float) -> list[str]:
    """Apply `methods` to `model` in place (`data`: the run's DataBundle); one line per method applied."""
    lines = []
    if "whiten" in methods:
        name, conv = first_conv(model)
        if not conv.weight.is_meta:  # (FSDP2's meta build on every rank: rank 0 builds the real weights)
            n = apply_whitening(conv, sample_images(data, seed), eps)
            lines.append(f"--init whiten: {name} ({conv.out_channels} filters of {conv.in_channels}x"
                         f"{'x'.join(map(str, conv.kernel_size))}): {2 * n} from the top {n} eigenvectors of the "
                         "training patches' second moments" + (f", {conv.out_channels - 2 * n} keep their init"
                                                                if conv.out_channels > 2 * n else ""))
    if "dirac" in methods:
        names = apply_dirac(model)
        lines.append(f"--init dirac: {len(names)} stride-1 convolution(s) start as the identity on their first "
                     "min(in, out) channels")
    return lines


def sample_images(data, seed: int, count: int = WHITEN_IMAGES) -> torch.Tensor:
    """Up to `count` training images (seeded choice, unreadable ones left out), normalised, evaluation geometry."""
    train = getattr(data, "train", None)
    if not hasattr(train, "images") or not hasattr(train, "indices"):
        raise UserError("--init whiten reads a sample of the training images by index; streamed WebDataset shards "
                        "have none: train from the image folder or CSV, or drop --init whiten")
    transform = build_transform(data.preprocess, False, source_size=train.images.side)
    order = torch.randperm(len(train.indices), generator=torch.Generator().manual_seed(seed))[:count]
    images = []
    for i in order.tolist():
        try:
            images.append(transform(train.images.load(int(train.indices[i]))))
        except BadImage:
            continue
    if not images:
        raise UserError("--init whiten: none of the sampled training images could be read")
    return torch.stack(images)


def patch_moments(images: torch.Tensor, kernel: tuple[int, int]) -> torch.Tensor:
    """The second-moment matrix (d x d, float64, d = c x kh x kw) of the images' kh x kw patches."""
    n, c, h, w = images.shape
    kh, kw = kernel
    if h < kh or w < kw:
        raise UserError(f"--init whiten: {h}x{w} images are smaller than the first convolution's {kh}x{kw} kernel")
    stride = 1
    while n * ((h - kh) // stride + 1) * ((w - kw) // stride + 1) > MAX_PATCHES:
        stride += 1
    d = c * kh * kw
    per_image = ((h - kh) // stride + 1) * ((w - kw) // stride + 1)
    chunk = max(1, CHUNK_VALUES // (per_image * d))
    moments, count = torch.zeros(d, d, dtype=torch.float64), 0
    for start in range(0, n, chunk):
        x = images[start:start + chunk].double()
        patches = x.unfold(2, kh, stride).unfold(3, kw, stride)  # (N, C, H', W', kh, kw)
        flat = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, d)  # one row per patch, laid out as a filter
        moments += flat.T @ flat
        count += len(flat)
    return moments / count


def whitening_filters(moments: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues, eigenvectors / sqrt(eigenvalue + eps) as rows), largest eigenvalue first."""
    values, vectors = torch.linalg.eigh(moments)  # ascending
    values, vectors = values.flip(0).clamp_min(0.0), vectors.flip(1)
    return values, vectors.T / (values + eps).sqrt()[:, None]


@torch.no_grad()
def apply_whitening(conv: nn.Conv2d, images: torch.Tensor, eps: float) -> int:
    """Set `conv`'s first filters to the whitening filters of `images`' patches and their negatives;
    returns how many eigenvectors it took."""
    if conv.groups != 1 or conv.in_channels != images.shape[1]:
        raise UserError(f"--init whiten: the first convolution reads {conv.in_channels} channels in "
                        f"{conv.groups} group(s), the images have {images.shape[1]}: it must read the image itself")
    if not math.isfinite(eps) or eps <= 0:
        raise UserError(f"--whiten-eps {eps}: give a small positive number (e.g. 5e-4)")
    kh, kw = conv.kernel_size
    _, filters = whitening_filters(patch_moments(images, (kh, kw)), eps)
    n = min(len(filters), conv.out_channels // 2)
    if n == 0:
        raise UserError(f"--init whiten: the first convolution has {conv.out_channels} out-channel(s); it needs "
                        "at least 2 (a filter and its negative)")
    top = filters[:n].reshape(n, conv.in_channels, kh, kw).to(conv.weight.dtype)
    conv.weight[:2 * n].copy_(torch.cat([top, -top]))
    return n


@torch.no_grad()
def apply_dirac(model: nn.Module) -> list[str]:
    """dirac_ on the first min(in, out) filters of every stride-1, ungrouped, 'same'-padded, odd-kernel
    Conv2d after the first; returns their names."""
    first = first_conv(model)[1]
    done = []
    for name, m in unwrap(model).named_modules():
        if not isinstance(m, nn.Conv2d) or m is first or m.weight.is_meta:
            continue
        kh, kw = m.kernel_size
        same = m.padding == (kh // 2, kw // 2) or m.padding == "same"
        if m.stride == (1, 1) and m.groups == 1 and m.dilation == (1, 1) and kh % 2 and kw % 2 and same:
            nn.init.dirac_(m.weight[:min(m.in_channels, m.out_channels)])
            done.append(name)
    return done


def freeze_first_conv(model: nn.Module) -> str:
    name, conv = first_conv(model)
    conv.weight.requires_grad_(False)
    return f"--freeze-first-conv: {name}.weight ({conv.weight.numel():,} values) is not trained"


class FirstBiasFreeze:
    """--freeze-first-bias-after-epochs N: from epoch N on (0-based: after N epochs), the first layer's bias
    takes no gradient, so the optimizer leaves it (and its momentum) as it is. Called at the start of every
    epoch, a resumed run's included, so a run resumed after epoch N freezes it again."""

    def __init__(self, model: nn.Module, after_epochs: int):
        if after_epochs < 0:
            raise UserError(f"--freeze-first-bias-after-epochs {after_epochs}: give a number of epochs >= 1, or 0")
        self.name, self.bias = first_bias(model)
        self.after_epochs = after_epochs

    def __call__(self, epoch: int, _step: int = 0) -> None:
        if epoch >= self.after_epochs and self.bias.requires_grad:
            self.bias.requires_grad_(False)
            self.bias.grad = None
