"""FastNet: a ResNet-style net for 28x28 inputs sized for a few minutes of CPU training.

The only convolution at full resolution is the thin stem; a strided convolution then halves
the image at each stage (28→14→7→4 px) while the width doubles (w→2w→4w→8w), with one
residual block at 14 and at 7 px. On 28x28 images a net's time goes mostly into its
full-resolution layers, so downsampling right after the stem buys width and depth for the
time: width 24 has 0.43M parameters and 46 MFLOP per 28x28 image, and none of its layers
works on more than 24 channels at 28x28. `stages` and `stage_channels` are public like
SmallNet's, so wrappers (early exits, FSDP per-block sharding) can address the blocks alike.
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


class FastNet(nn.Module):
    def __init__(self, num_classes: int = 10, in_chans: int = 1, width: int = 24, drop_rate: float = 0.0):
        super().__init__()
        w = width
        self.stage_channels = (2 * w, 4 * w, 8 * w)
        self.stem = conv_bn(in_chans, w)
        self.stages = nn.ModuleList([
            nn.Sequential(conv_bn(w, 2 * w, stride=2), Residual(2 * w)),
            nn.Sequential(conv_bn(2 * w, 4 * w, stride=2), Residual(4 * w)),
            conv_bn(4 * w, 8 * w, stride=2),
        ])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(drop_rate),
                                  nn.Linear(8 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)
