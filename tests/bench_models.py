"""Tiny models for `bench compile` tests: one with exactly one known graph break, one that fails."""

import torch
from torch import nn


class BreakNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        x = torch.relu(self.a(x.flatten(1)))
        torch._dynamo.graph_break()  # the known break: two graphs
        return self.b(x)


class FailingNet(nn.Module):
    def forward(self, x):
        raise RuntimeError("FailingNet always fails")


def break_net():
    return BreakNet(), torch.randn(1, 2, 4, 4)


def failing_net():
    return FailingNet(), torch.randn(1, 2, 4, 4)
