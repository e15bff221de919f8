"""FastNet: a ResNet-style net for 28x28 inputs sized for a few minutes of CPU training.

The only convolution at full resolution is the thin stem; a strided convolution then halves
the image at each stage (28→14→7→4 px) while the width doubles (w→2w→4w→8w), with one
residual block at 14 and at 7 px. On 28x28 images a net's time goes mostly into its
full-resolution layers, so downsampling right after the stem buys width and depth for the
time: width 24 has 0.43M parameters and 46 MFLOP per 28x28 image, and none of its layers
works on more than 24 channels at 28x28. `stages` and `stage_channels` are public like
SmallNet's, so wrappers (early exits, FSDP per-block sharding) can address the blocks alike.

`fastnet_slim` narrows only the two full- and half-resolution widths (16 and 32 channels at 28
and 14 px, where 24 and 48 cost 45% of the FLOPs) and keeps the 7 and 4 px ones (96, 192), where
the capacity that the accuracy needs is cheap: 0.39M parameters and 33 MFLOP; its training step took 1.48x
less time than fastnet's on a 2-core AVX-512-bf16 CPU, for 0.15 points less top-1 at 6 epochs (docs/training.md).

`fastnet_lite` is fastnet_slim without the residual block at 14 px (`blocks`: residual blocks at 14 and 7 px):
that block has 5% of the parameters and 21% of the FLOPs, but 32-channel convolutions run far below the CPU's
peak, so its training step takes 1.48x less time than fastnet_slim's (fp32, a 2-core AVX2-only CPU), for about
the same top-1 after 7 epochs (median of 3 seeds, docs/training.md).
"""

from __future__ import annotations

import torch
from torch import nn


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Residual(nn.Module):
    """x + two conv-BN-ReLU layers of the same width."""

    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(c, c), conv_bn(c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


# --model name -> channels of the stem and of the 14, 7 and 4 px stages
WIDTHS: dict[str, tuple[int, int, int, int]] = {
    "fastnet": (24, 48, 96, 192), "fastnet_slim": (16, 32, 96, 192), "fastnet_lite": (16, 32, 96, 192)}
# --model name -> residual blocks at 14 and 7 px, where not (1, 1)
BLOCKS: dict[str, tuple[int, int]] = {"fastnet_lite": (0, 1)}


class FastNet(nn.Module):
    def __init__(self, num_classes: int = 10, in_chans: int = 1, width: int = 24, drop_rate: float = 0.0,
                 widths: tuple[int, int, int, int] | None = None, blocks: tuple[int, int] = (1, 1)):
        super().__init__()
        stem, c14, c7, c4 = widths or (width, 2 * width, 4 * width, 8 * width)
        self.stage_channels = (c14, c7, c4)
        self.stem = conv_bn(in_chans, stem)
        self.stages = nn.ModuleList([
            nn.Sequential(conv_bn(stem, c14, stride=2), *(Residual(c14) for _ in range(blocks[0]))),
            nn.Sequential(conv_bn(c14, c7, stride=2), *(Residual(c7) for _ in range(blocks[1]))),
            conv_bn(c7, c4, stride=2),
        ])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(drop_rate),
                                  nn.Linear(c4, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)
