"""The worst errors of an evaluation: the misclassified images the model was surest of, as thumbnails.

People look at these before any table: a wrong label in the data, a class that needs more examples, or
an input the model was never meant to see shows at a glance. eval.json lists them (file, true and
predicted label, confidence) and <out>/misclassified/NN.png holds each image, at most 96 px a side
(the report embeds them).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import torch

from torchcls.run_files import replace_file, sub_dir

GALLERY_SIZE = 16  # a row or two in the report: enough to see a pattern, few enough to look at each
THUMBNAIL_SIDE = 96


def worst_errors(logits: torch.Tensor, targets: torch.Tensor, dataset, classes: list[str], out_dir: Path,
                 n: int = GALLERY_SIZE) -> list[dict[str, Any]]:
    """The `n` misclassified samples with the most confident wrong prediction, thumbnails written to
    out_dir/misclassified/. [] when there is none, or when samples skipped while decoding (--on-bad-file
    skip) broke the alignment of logits and dataset indices."""
    folder = out_dir / "misclassified"
    _remove_thumbnails(folder)  # a previous evaluation's would be stale
    images, indices = getattr(dataset, "images", None), getattr(dataset, "indices", None)
    if images is None or indices is None or len(logits) != len(indices) or targets.ndim != 1:
        return []
    probs = logits.float().softmax(dim=1)
    confidence, predicted = probs.max(dim=1)
    wrong = (predicted != targets).nonzero().flatten()
    worst = wrong[confidence[wrong].argsort(descending=True)][:n].tolist()
    if worst:
        sub_dir(folder, "the thumbnails folder")  # a link there would take the thumbnails wherever it points
    found = []
    for rank, i in enumerate(worst):
        j = int(indices[i])
        thumbnail = folder / f"{rank:02d}.png"
        _thumbnail(images.load(j), thumbnail)
        t, p = int(targets[i]), int(predicted[i])
        found.append({"file": str(images.paths[j]) if images.paths is not None else f"{images.name}[{j}]",
                      "true": classes[t], "predicted": classes[p], "confidence": round(confidence[i].item(), 4),
                      "true_prob": round(probs[i, t].item(), 4), "thumbnail": f"misclassified/{thumbnail.name}"})
    return found


def _remove_thumbnails(folder: Path) -> None:
    """Delete the thumbnails an evaluation writes (NN.png, regular files), nothing else: the folder is found
    by name in a run dir that may be someone else's, and a name is no proof of what a file is."""
    if not folder.is_dir() or folder.is_symlink():
        return
    for rank in range(GALLERY_SIZE):
        name = folder / f"{rank:02d}.png"
        try:
            if stat.S_ISREG(os.lstat(name).st_mode):
                name.unlink()
        except OSError:
            pass


def _thumbnail(image: torch.Tensor, path: Path) -> None:
    """uint8 (C, H, W) -> a PNG at most THUMBNAIL_SIDE a side, aspect kept (small images stay small: the
    report scales them up without smoothing)."""
    from PIL import Image

    array = image.permute(1, 2, 0).numpy()
    pil = Image.fromarray(array[..., 0] if array.shape[2] == 1 else array)
    pil.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
    replace_file(path, lambda tmp: pil.save(tmp, format="PNG"))  # the name replaced, never written through
