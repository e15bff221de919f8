"""The report's first section: the misclassified images the model was surest of (torchcls.evaluation.worst_errors),
each with its predicted and true label, embedded as thumbnails."""

from __future__ import annotations

import os
from pathlib import Path

from torchcls.evaluation.worst_errors import GALLERY_SIZE
from torchcls.report.htmlkit import esc, img
from torchcls.report.sections import read_json, section
from torchcls.run_files import inside

# What the page embeds is bounded by what evaluate writes, not by what eval.json lists: a received eval.json
# could name one large file a thousand times. Thumbnails are at most 96 px a side: a few KB each.
MAX_THUMBNAIL_BYTES = 256 << 10


@section("misclassified", "Worst errors", "torchcls evaluate RUN_DIR", 5)
def misclassified(run_dir: Path) -> str | None:
    ev = read_json(run_dir / "eval.json")
    if not ev or "misclassified" not in ev:
        return None
    # eval.json names each thumbnail: only a path inside the run dir, with no link on the way, is embedded
    items = [{**e, "thumbnail": inside(run_dir, e["thumbnail"], "thumbnail")} for e in ev["misclassified"][:GALLERY_SIZE]]
    items = [e for e in items if os.path.lexists(e["thumbnail"])]
    if not items:
        return f"<p>No misclassified images in {esc(ev['data'])} [{esc(ev['split'])}] ({esc(ev['n'])} images).</p>"
    figures = "".join(
        f"<figure>{img(e['thumbnail'], MAX_THUMBNAIL_BYTES)}<figcaption><b class='wrong'>{esc(e['predicted'])}</b> "
        f"{e['confidence']:.0%}<br>true: <b>{esc(e['true'])}</b><br><small>{esc(Path(e['file']).name)}</small>"
        "</figcaption></figure>" for e in items)
    wrong = round((1 - ev["top1"]) * ev["n"])
    return (f"<p>The {len(items)} of {wrong} misclassified images of {esc(ev['data'])} [{esc(ev['split'])}] the model "
            "was surest of: predicted label (red) with its probability, then the true label.</p>"
            f"<div class='gallery'>{figures}</div>")
