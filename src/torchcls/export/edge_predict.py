"""`torchcls predict PROGRAM.pte IMAGES...`: the same predictions as for a checkpoint, computed by
the ExecuTorch runtime from the program alone (class names and preprocessing come from the program),
so a user can check a program before shipping it to a device."""

from __future__ import annotations

from pathlib import Path

import torch

from torchcls.data import build_transform
from torchcls.data.images import BadImage, load_image
from torchcls.errors import UserError
from torchcls.export.artifact import load_artifact
from torchcls.predict import Predictions, expand_inputs


def predict_pte(program: str | Path, inputs: list[str | Path], topk: int = 5, on_bad_file: str = "error",
                batch_size: int = 64) -> Predictions:
    artifact = load_artifact(program)
    info = artifact.info
    transform = build_transform(info.preprocess, train=False)
    result = Predictions([])
    good: list[tuple[Path, torch.Tensor]] = []
    for f in expand_inputs(inputs):
        try:
            good.append((f, transform(load_image(f, info.preprocess.channels))))
        except BadImage as e:
            if on_bad_file == "error":
                raise UserError(f"{f}: {e} (pass --on-bad-file skip to leave it out)") from None
            result.skipped.append({"file": str(f), "reason": str(e)})
    k = min(topk, len(info.classes))
    step = max(1, min(batch_size, info.max_batch))  # the program's memory plan bounds the batch
    for start in range(0, len(good), step):
        chunk = good[start:start + step]
        probs = artifact(torch.stack([t for _, t in chunk])).softmax(dim=1)
        values, indices = probs.topk(k, dim=1)
        for (f, _), vals, idx in zip(chunk, values, indices):
            result.items.append({"file": str(f), "top": [{"label": info.classes[i], "prob": round(v, 6)}
                                                         for v, i in zip(vals.tolist(), idx.tolist())]})
    return result
