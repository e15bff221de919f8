"""Early-exit classifiers: a backbone cut into segments, with a small classifier after each.

Training (model.train()): forward returns the logits of EVERY exit (a tuple, last = the
backbone's own head) and `exit_loss` weights their losses, so autograd reaches every
branch. Inference (model.eval()): per sample, the first exit whose confidence (max
softmax probability) reaches `threshold` answers; samples that are not confident enough
go on to the next segment. This is real data-dependent Python control flow: only the
samples still undecided are computed further, and the loop stops when none is left.
`CondEarlyExit` is the same model with the decision written as `torch.cond`, for
torch.compile(fullgraph=True) and torch.export (what `torchcls export` captures).

Backbones: SmallNet (exits after its stages) and timm ResNets (exits after layer1..3).
Model names: `ee/<backbone>` (e.g. `ee/smallnet`, `ee/resnet18`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torchcls.errors import UserError

PREFIX = "ee/"
DEFAULT_THRESHOLD = 0.9


class ExitHead(nn.Module):
    """A cheap classifier on intermediate features: 4x4 average pool, then a 2-layer MLP.

    Keeping a 4x4 spatial grid (not a global pool) lets an early exit see where things are,
    which a linear probe on globally pooled shallow features cannot (~0.2% of SmallNet's FLOPs).
    """

    def __init__(self, channels: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(channels * 16, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class EarlyExitNet(nn.Module):
    """`segments[k]` then `heads[k]` is exit k; the last head is the backbone's own classifier."""

    def __init__(self, segments: Sequence[nn.Module], heads: Sequence[nn.Module], threshold: float = DEFAULT_THRESHOLD,
                 loss_weights: Sequence[float] | None = None):
        super().__init__()
        if len(segments) != len(heads) or len(segments) < 2:
            raise ValueError("an early-exit net needs matching segments and heads, at least two")
        self.segments = nn.ModuleList(segments)
        self.heads = nn.ModuleList(heads)
        self.threshold = check_threshold(threshold)
        # Deeper exits weigh more: the final head must stay as good as the plain backbone's.
        weights = loss_weights or [(k + 1) for k in range(len(segments))]
        self.loss_weights = tuple(w / sum(weights) for w in weights)

    @property
    def num_exits(self) -> int:
        return len(self.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.training:
            return self.all_exits(x)
        return self.dynamic(x)[0]

    def all_exits(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Logits of every exit for every sample (training, and the calibration sweep)."""
        out = []
        for segment, head in zip(self.segments, self.heads):
            x = segment(x)
            out.append(head(x))
        return tuple(out)

    def exit_logits(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of exit k only (what `explain` attributes for a sample that left there)."""
        for segment in self.segments[:k + 1]:
            x = segment(x)
        return self.heads[k](x)

    def dynamic(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample early exit: (logits, index of the exit each sample left at)."""
        n = x.shape[0]
        logits_out: torch.Tensor | None = None
        exit_index = torch.full((n,), self.num_exits - 1, dtype=torch.long, device=x.device)
        alive = torch.arange(n, device=x.device)  # samples not decided yet
        h = x
        for k, (segment, head) in enumerate(zip(self.segments, self.heads)):
            h = segment(h)
            logits = head(h)
            if logits_out is None:
                logits_out = logits.new_zeros((n, logits.shape[1]))
            if k == self.num_exits - 1:
                logits_out = logits_out.index_put((alive,), logits)
                break
            done = confidence(logits) >= self.threshold
            logits_out = logits_out.index_put((alive[done],), logits[done])
            exit_index[alive[done]] = k
            if bool(done.all()):  # the data decides: nothing left to compute
                break
            keep = ~done
            alive, h = alive[keep], h[keep]
        return logits_out, exit_index


class CondEarlyExit(nn.Module):
    """The export-friendly form: forward(x) -> (logits, exit index per sample as float), with torch.cond.

    A Python `if` on a tensor breaks the graph under torch.compile and fails torch.export
    (GuardOnDataDependentSymNode). Here the decision stays in the graph: after exit k, if every
    sample of the batch is confident, `torch.cond` returns the answers gathered so far and the
    deeper segments are not run; otherwise it runs the rest, and each sample keeps the logits of
    the first exit where it was confident (torch.where). Per sample that is exactly the eager
    rule, so predictions are identical; compute is skipped when the whole batch agrees (always
    the case at batch 1, the usual edge/serving shape).
    """

    def __init__(self, model: EarlyExitNet):
        super().__init__()
        self.model = model.eval()
        self.threshold = model.threshold

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.model.segments[0](x)
        logits = self.model.heads[0](h)
        decided = confidence(logits) >= self.threshold
        index = torch.zeros_like(decided, dtype=torch.float32)  # float: fewer int kernels on edge runtimes
        return self._from(1, h, logits, decided, index)

    def _from(self, k: int, h, acc, decided, index):
        """Exits k.. for the samples not `decided` yet; `acc` holds the answers so far."""

        def stop(h, acc, decided, index):
            return acc.clone(), index.clone()  # cond branches may not return their inputs

        def go_on(h, acc, decided, index):
            h = self.model.segments[k](h)
            logits = self.model.heads[k](h)
            acc = torch.where(decided[:, None], acc, logits)
            index = torch.where(decided, index, torch.full_like(index, k))
            if k == self.model.num_exits - 1:
                return acc, index
            return self._from(k + 1, h, acc, decided | (confidence(logits) >= self.threshold), index)

        return torch.cond(decided.all(), stop, go_on, (h, acc, decided, index))


def confidence(logits: torch.Tensor) -> torch.Tensor:
    """The exit criterion: the max softmax probability of each sample."""
    return logits.float().softmax(dim=1).amax(dim=1)


def check_threshold(threshold: float) -> float:
    if not 0.0 <= float(threshold) <= 1.0:
        raise UserError(f"early-exit threshold {threshold} is outside [0, 1]: it is a softmax confidence "
                        "(e.g. 0.9; 0 = always leave at the first exit, 1 = almost always run the whole net)")
    return float(threshold)


def exit_loss(criterion: nn.Module, logits, y: torch.Tensor, model: nn.Module | None = None):
    """(loss, final logits) for a plain model's logits or an early-exit model's tuple of exit logits.

    The training loop's seam: a plain tensor gives criterion(logits, y) unchanged; a tuple
    gives the weighted sum of each exit's loss (weights from the model, else equal).
    """
    if isinstance(logits, torch.Tensor):
        return criterion(_upcast(logits), y), logits
    weights = getattr(_unwrap(model), "loss_weights", None) or [1.0 / len(logits)] * len(logits)
    loss = sum(w * criterion(_upcast(out), y) for w, out in zip(weights, logits))
    return loss, logits[-1]


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits (autocast) → fp32 for the loss; fp32 and fp64 stay as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _unwrap(model: nn.Module | None) -> nn.Module | None:
    while model is not None and hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module  # DDP / compiled wrappers
    return getattr(model, "_orig_mod", model)


def build_early_exit(backbone_name: str, backbone: nn.Module, num_classes: int, exits: int, threshold: float) -> EarlyExitNet:
    """Cut `backbone` into exits+1 segments; `exits` = intermediate exits (0 = every place it offers)."""
    check_threshold(threshold)
    cuts = _cut_points(backbone_name, backbone)
    if exits < 0 or exits > len(cuts) - 1:
        raise UserError(f"model '{PREFIX}{backbone_name}' offers 1 to {len(cuts) - 1} intermediate exits "
                        f"(after each of its first {len(cuts) - 1} stages); --exits {exits} is not possible")
    # The earliest stage boundaries get the exits: they are the ones that save the most compute.
    chosen = list(range(exits or len(cuts) - 1))
    segments, heads, start = [], [], 0
    for i in chosen:
        segments.append(nn.Sequential(*[m for part in cuts[start:i + 1] for m in part[0]]))
        heads.append(ExitHead(cuts[i][1], num_classes))
        start = i + 1
    segments.append(nn.Sequential(*[m for part in cuts[start:] for m in part[0]]))
    heads.append(_final_head(backbone_name, backbone))
    return EarlyExitNet(segments, heads, threshold)


def _cut_points(name: str, backbone: nn.Module) -> list[tuple[list[nn.Module], int]]:
    """The backbone as stages: (modules of the stage, its output channels)."""
    from torchcls.models.smallnet import SmallNet

    if isinstance(backbone, SmallNet):
        stages = list(backbone.stages)
        return [([backbone.stem, stages[0]], backbone.stage_channels[0])] + [
            ([s], c) for s, c in zip(stages[1:], backbone.stage_channels[1:])]
    if all(hasattr(backbone, a) for a in ("conv1", "bn1", "layer1", "layer4", "global_pool", "fc")):  # timm ResNet
        layers = [getattr(backbone, f"layer{i}") for i in range(1, 5)]
        chans = [_out_channels(layer) for layer in layers]
        stem = [backbone.conv1, backbone.bn1, backbone.act1, backbone.maxpool]
        return [(stem + [layers[0]], chans[0])] + [([layer], c) for layer, c in zip(layers[1:], chans[1:])]
    raise UserError(f"model family of '{name}' has no early-exit support; use '{PREFIX}smallnet' or a timm "
                    f"ResNet ('{PREFIX}resnet18', '{PREFIX}resnet50', ...)")


def _out_channels(layer: nn.Module) -> int:
    # Every block of a ResNet stage ends in the same width; the downsample conv shares it too.
    return [m for m in layer.modules() if isinstance(m, nn.Conv2d)][-1].out_channels


def _final_head(name: str, backbone: nn.Module) -> nn.Module:
    from torchcls.models.smallnet import SmallNet

    if isinstance(backbone, SmallNet):
        return backbone.head
    return _ResNetFinal(backbone.global_pool, backbone.fc, getattr(backbone, "drop_rate", 0.0))


class _ResNetFinal(nn.Module):
    def __init__(self, pool: nn.Module, fc: nn.Module, drop_rate: float):
        super().__init__()
        self.global_pool, self.drop, self.fc = pool, nn.Dropout(drop_rate), fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.global_pool(x)))
