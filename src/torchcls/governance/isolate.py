"""The isolated processing path for file-backed data: every file passes the "file" hooks once
into a run-private directory, and training reads only from there.

Copies are named by the original's SHA-256, so neither the copies nor anything that lists them
(the skipped-files table, errors) carries the original file names, which may be personal data.
"""

from __future__ import annotations

import csv
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torchcls.data.images import decode_to_pil, read_image_file
from torchcls.errors import UserError
from torchcls.governance.hooks import Hook, SampleInfo
from torchcls.governance.integrity import record_path

_PNG_MODES = {"1", "L", "LA", "P", "RGB", "RGBA", "I;16"}


def isolate(manifest: dict[str, Any], infos: list[SampleInfo], hooks: list[Hook], workdir: Path,
            on_bad_file: str) -> tuple[Path, list[tuple[SampleInfo, str]]]:
    """Write hooked copies and a `path,label[,split]` CSV listing them; returns (csv, [(sample, reason)] of
    bad files)."""
    records = manifest["tc:records"]
    _check_labelled(records, infos)
    workdir.mkdir(parents=True, exist_ok=True)

    def one(i: int) -> tuple[str | None, str | None]:
        r, info = records[i], infos[i]
        try:
            # The one decoder's checks (format from the bytes, every size bounded before decoding), upright.
            im = decode_to_pil(read_image_file(record_path(manifest, r)))
            for h in hooks:
                im = h.fn(im, info)
            suffix = ".png" if im.mode in _PNG_MODES else ".tiff"
            out = workdir / f"{r['sha256']}{suffix}"
            im.save(out)
            return str(out), None
        except Exception as e:  # any undecodable file: reported like the loader reports bad files
            return None, f"unreadable before isolation: {type(e).__name__}: {e}"

    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        results = list(pool.map(one, range(len(records))))
    bad = [(infos[i], reason) for i, (_, reason) in enumerate(results) if reason]
    if bad and on_bad_file == "error":
        listing = "\n".join(f"  sha256:{s.sha256[:16]} ({s.id if not s.restricted else 'restricted'}): {r}"
                            for s, r in bad[:20])
        raise UserError(f"{len(bad)} unreadable image file(s) on the isolated path:\n{listing}\n"
                        "Fix or remove them, or pass --on-bad-file skip")
    csv_path = workdir / "data.csv"
    splits = any("split" in r for r in records)  # the source's train/val/test stay apart
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label", *(["split"] if splits else [])])
        for (out, _), r in zip(results, records):
            if out is not None:
                writer.writerow([out, r["label"], *([r.get("split", "train")] if splits else [])])
    return csv_path, bad


def _check_labelled(records: list[dict[str, Any]], infos: list[SampleInfo]) -> None:
    """Training reads the labels from the manifest here, where the schema leaves them optional: refuse an
    unlabelled record before any copy is written (the CSV loader would refuse its empty label only after)."""
    for r, s in zip(records, infos):
        if not (isinstance(r.get("label"), str) and r["label"]):
            raise UserError(f"--data-manifest: record sha256:{s.sha256 and s.sha256[:16]} "
                            f"({s.id if not s.restricted else 'restricted'}) has no label, and the isolated path "
                            "trains on the manifest's labels: rebuild the manifest from the labelled data "
                            "(torchcls data manifest)")
