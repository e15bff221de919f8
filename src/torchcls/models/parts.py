"""Where a model's classifier head and stages are, for any model torchcls builds, from outside its code.

`classifier_modules`: the layer(s) that produce the logits (what --head-lr speeds up and --freeze
backbone leaves trainable). `stage_map`: every parameter's stage, 0 = the stem, 1..S = the stages,
S + 1 = the head and anything after the last stage (what --freeze stages:N and the --layer-decay
fallback count). Families: timm models (their get_classifier() and coarse group_matcher, the same
grouping timm's layer decay uses), SmallNet, torchvision ResNets (layer1..4) and torchvision models
with a `features` Sequential (features[0] is the stem), early-exit models (head only). `is_convnet`: whether its memory layout should be channels_last.
"""

from __future__ import annotations

from torch import nn

from torchcls.errors import UserError


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (.module) and torch.compile (._orig_mod) wrappers; FSDP2 shards in place."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def is_convnet(model: nn.Module) -> bool:
    """channels_last pays for convolution-heavy nets (oneDNN/cuDNN NHWC kernels), not for a ViT
    whose only convolution is the patch embedding."""
    return sum(isinstance(m, nn.Conv2d) for m in model.modules()) >= 3


def classifier_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose parameters form the classifier head (non-empty)."""
    from torchcls.models.early_exit import EarlyExitNet

    net = unwrap(model)
    if isinstance(net, EarlyExitNet):  # every exit's classifier, the backbone's own head last
        return list(net.heads)
    get = getattr(net, "get_classifier", None)  # timm
    if callable(get):
        head = get()
        if isinstance(head, nn.Module) and any(True for _ in head.parameters()):
            return [head]
    # SmallNet and torchvision: the last Linear (or a 1x1 Conv2d classifier, as in SqueezeNet) registered.
    last = [m for m in net.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    if not last:
        raise UserError(f"cannot find the classifier of {type(net).__name__} (no Linear or Conv2d layer)")
    return [last[-1]]


def head_parameter_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in classifier_modules(model) for p in m.parameters()}


def stage_map(model: nn.Module) -> tuple[dict[str, int], int]:
    """({parameter name: stage}, number of stages S): 0 = stem, 1..S = stages, S + 1 = head and after."""
    from torchcls.models.early_exit import EarlyExitNet
    from torchcls.models.smallnet import SmallNet

    net = unwrap(model)
    names = [n for n, _ in net.named_parameters()]
    if isinstance(net, EarlyExitNet):
        raise UserError("early-exit models (ee/...) have no stage map: use --freeze backbone (every exit's "
                        "classifier stays trainable) and --head-lr; --freeze stages:N and --layer-decay apply "
                        "to plain models")
    if hasattr(net, "group_matcher") and callable(net.group_matcher):  # timm
        return _timm_stages(net)
    if isinstance(net, SmallNet):
        prefixes = [["stem."]] + [[f"stages.{i}."] for i in range(len(net.stages))]
    elif all(hasattr(net, f"layer{i}") for i in range(1, 5)):  # torchvision ResNet, ResNeXt, Wide ResNet
        prefixes = [["conv1.", "bn1."]] + [[f"layer{i}."] for i in range(1, 5)]
    elif isinstance(getattr(net, "features", None), nn.Sequential):  # VGG, MobileNet, EfficientNet, ConvNeXt...
        prefixes = [[f"features.{i}."] for i in range(len(net.features))]
    else:
        raise UserError(f"{type(net).__name__} has no known stages; --freeze stages:N and --layer-decay support "
                        "timm models, smallnet, torchvision ResNets and torchvision models with a `features` "
                        "block (vgg, mobilenet, efficientnet, convnext, ...); use --freeze backbone or --head-lr")
    stages = len(prefixes) - 1
    ids = {n: next((i for i, group in enumerate(prefixes) if any(n.startswith(p) for p in group)), stages + 1)
           for n in names}
    return ids, stages


def _timm_stages(net: nn.Module) -> tuple[dict[str, int], int]:
    from timm.models import group_parameters

    ids = group_parameters(net, net.group_matcher(coarse=True), reverse=True)
    head = {n for n, p in net.named_parameters() if id(p) in head_parameter_ids(net)}
    head_group = min((ids[n] for n in head), default=max(ids.values()) + 1)
    # The group that holds the classifier (with any final norm or conv timm puts beside it) is the head.
    return {n: min(i, head_group) for n, i in ids.items()}, head_group - 1
