"""`torchcls explain`: what drove a prediction, as attribution maps over the input (captum).

Integrated gradients (default) or plain input gradients (saliency), for the predicted class
(or a given one). For an early-exit model the attribution is taken through the exit the
image actually left at, so the map explains the answer the model gave, not the deepest head.
Each image gets one PNG: the input, and the attribution overlaid on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchcls.checkpoint.files import load_model, output_dir_of, resolve_checkpoint
from torchcls.data import build_transform
from torchcls.data.images import BadImage, load_image
from torchcls.errors import UserError
from torchcls.extras import missing_extra
from torchcls.options import ExplainOptions as _D  # the defaults (and ranges), declared once
from torchcls.options import check_values
from torchcls.prediction import expand_inputs
from torchcls.run_files import replace_file, sub_dir

METHODS = ("integrated-gradients", "saliency")
# Integrated-gradients steps run this many at a time (captum's internal_batch_size): without it captum stacks all
# --steps copies of the image into one batch, so memory grew with --steps (10^7 steps: 10^7 images at once).
EXPLAIN_BATCH = 32


@dataclass
class Explanation:
    file: str
    png: str
    label: str
    prob: float
    target: str
    exit: int | None  # early-exit models: the exit the image left at


def explain(checkpoint: str | Path, images: list[str | Path], method: str = _D.method,
            target: str | None = None, out_dir: str | Path | None = None, steps: int = _D.steps,
            on_bad_file: str = _D.on_bad_file) -> list[Explanation]:
    """Write one attribution PNG per image into out_dir (default: <run dir>/explain)."""
    if method not in METHODS:
        raise UserError(f"--method {method}: choose one of {', '.join(METHODS)}")
    check_values(_D, "explain", steps=steps)  # captum asserts steps > 0; the max bounds the time per image
    try:
        from captum.attr import IntegratedGradients, Saliency
    except ImportError:
        raise missing_extra("explain", "torchcls explain", "captum") from None
    path = resolve_checkpoint(checkpoint)
    model, meta = load_model(path)
    if target is not None and target not in meta.classes:
        raise UserError(f"--target {target!r} is not a class of this model (it knows: {', '.join(meta.classes)})")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)  # (the user's folder: a link there is theirs)
    else:
        out = sub_dir(output_dir_of(path) / "explain", "the explain folder")
    transform = build_transform(meta.preprocess, train=False)
    results = []
    for f in expand_inputs(images):
        try:
            x = transform(load_image(f, meta.preprocess.channels))[None]
        except BadImage as e:
            if on_bad_file == "error":
                raise UserError(f"{f}: {e} (pass --on-bad-file skip to leave it out)") from None
            continue
        forward, exit_k = _forward_for(model, x)
        with torch.no_grad():
            logits = forward(x).float()  # multilabel: each class's own sigmoid; the attribution is of its logit
            probs = (logits.sigmoid() if meta.task == "multilabel" else logits.softmax(dim=1))[0]
        pred = int(probs.argmax())
        t = meta.classes.index(target) if target is not None else pred
        algo = IntegratedGradients(forward) if method == "integrated-gradients" else Saliency(forward)
        kwargs = ({"n_steps": steps, "internal_batch_size": min(steps, EXPLAIN_BATCH)}
                  if method == "integrated-gradients" else {"abs": True})
        attr = algo.attribute(x.clone().requires_grad_(True), target=t, **kwargs).detach()
        png = out / f"{f.stem}.{method}.png"
        _overlay(x[0], attr[0], meta.preprocess, png, f"{meta.classes[pred]} ({probs[pred]:.2f})"
                 + (f", exit {exit_k}" if exit_k is not None else ""), f"{method} for '{meta.classes[t]}'")
        results.append(Explanation(str(f), str(png), meta.classes[pred], float(probs[pred]), meta.classes[t], exit_k))
    if not results:
        raise UserError("no readable images to explain")
    return results


def _forward_for(model: torch.nn.Module, x: torch.Tensor) -> tuple[Any, int | None]:
    """The function to attribute: the model, or for early-exit models the exit this image takes."""
    from torchcls.models.early_exit import EarlyExitNet

    if not isinstance(model, EarlyExitNet):
        return model, None
    with torch.no_grad():
        k = int(model.dynamic(x)[1][0])
    return (lambda inp: model.exit_logits(inp, k)), k


def _overlay(x: torch.Tensor, attr: torch.Tensor, pre, path: Path, title: str, attr_title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean, std = torch.tensor(pre.mean)[:, None, None], torch.tensor(pre.std)[:, None, None]
    image = (x * std + mean).clamp(0, 1).permute(1, 2, 0).numpy()
    heat = attr.abs().sum(dim=0)
    heat = (heat / heat.max().clamp_min(1e-12)).numpy()  # relative importance in [0, 1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(6.4, 3.4))
    cmap = "gray" if image.shape[2] == 1 else None
    for ax in (a, b):
        ax.imshow(image[..., 0] if cmap else image, cmap=cmap)
        ax.axis("off")
    b.imshow(heat, cmap="inferno", alpha=0.6)
    a.set_title(title, fontsize=9)
    b.set_title(attr_title, fontsize=9)
    fig.tight_layout()
    try:
        replace_file(path, lambda tmp: fig.savefig(tmp, dpi=100))  # the name replaced, never written through
    finally:
        plt.close(fig)
