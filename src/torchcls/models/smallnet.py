"""SmallNet: a compact ResNet for 28x28 inputs (MNIST, Fashion-MNIST), the demo's model.

Three stages of pre-activation-free basic blocks (16→32→64 channels, 28→14→7 px),
78k parameters, 19 MFLOP per 28x28 image. `stages` and `stage_channels` are public so that wrappers (early
exits, FSDP per-block sharding) can address the blocks without knowing the class.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallNet(nn.Module):
    def __init__(self, num_classes: int = 10, in_chans: int = 1, width: int = 16, drop_rate: float = 0.0):
        super().__init__()
        w = width
        self.stage_channels = (w, 2 * w, 4 * w)
        self.stem = nn.Sequential(nn.Conv2d(in_chans, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.stages = nn.ModuleList([
            BasicBlock(w, w),
            BasicBlock(w, 2 * w, stride=2),
            BasicBlock(2 * w, 4 * w, stride=2),
        ])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(drop_rate),
                                  nn.Linear(4 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)
