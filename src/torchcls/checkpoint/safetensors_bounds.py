"""A safetensors file's header, checked against stated bounds before any library reads the file.

A safetensors file is 8 bytes of header length, a JSON header (per tensor: dtype, shape, byte
range of the data; `__metadata__`: strings) and the data. It holds no code, but every number in it
is the file's word: the length decides how much is read and parsed, the shapes how much a reader
allocates and how long it computes over them (DCP's reader turns each shape into sizes and chunk
lists). Here the file is opened without blocking and checked to be a regular file, the header length
bounded, the JSON parsed under bounds (bounded_json.py), and every entry checked: a known
dtype, a rank and each dimension under a bound, an element count computed with an early stop, a
byte range that is exactly the element count's bytes, inside the file, the ranges tiling the data
with no gap or overlap (what the safetensors format requires). Any failure is a UserError naming
the file, before the safetensors library or torch has seen it.

`check_safetensors_header` is shared: DCP shards (checkpoint/hf_dcp.py) and single-file weights use it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.io_files import open_regular

# Bytes per element of each dtype name safetensors writes that torch reads (sub-byte types excluded).
DTYPE_BYTES: dict[str, int] = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
METADATA = "__metadata__"
ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


@dataclass(frozen=True)
class SafetensorsBounds:
    # One rank's shard of a model of 1,000 parameters with two optimizer moments each is ~4,000 entries,
    # ~1 MB of header with DCP's offsets; the safetensors library's own limit is 100 MB. Parsing a
    # crafted header of this size costs at most ~100 MB (see _check_counts).
    max_header_bytes: int = 8 * 2**20
    max_tensors: int = 50_000  # entries of one file
    max_ndim: int = 8  # a conv3d weight has 5 dims; nothing torchcls trains has more than 6
    max_dim: int = 2**40  # one dimension (also bounds a DCP offset + size)
    max_numel: int = 2**40  # elements of one tensor
    max_name: int = 1024  # characters of a tensor name or metadata key
    max_metadata_value: int = 16 * 2**20  # characters of one __metadata__ value

    def json_bounds(self) -> JsonBounds:
        # Per tensor the header holds 1 object and 2 arrays, DCP's offsets 1 object and 1 array; a
        # value count of 4 per dimension + 8 per entry covers the header's shapes, offsets and strings.
        return JsonBounds(max_bytes=self.max_header_bytes, max_values=(8 + 4 * self.max_ndim) * self.max_tensors,
                          max_depth=4, max_str=max(self.max_name, self.max_metadata_value))


DEFAULT_BOUNDS = SafetensorsBounds()


def bounded_numel(shape: list[int], bound: int) -> int | None:
    """The product of `shape`, or None as soon as a partial product passes `bound` (never a huge
    integer: math.prod over a thousand dims of 2**62 takes quadratic time in their digits)."""
    n = 1
    for d in shape:
        n *= d
        if n > bound:
            return None
    return n


def is_dim_list(value: Any, max_len: int, max_value: int) -> bool:
    """A JSON list of at most `max_len` ints (not bools) in [0, max_value]."""
    return (type(value) is list and len(value) <= max_len
            and all(type(d) is int and 0 <= d <= max_value for d in value))


def read_header_bytes(path: str | os.PathLike, bounds: SafetensorsBounds, follow_symlinks: bool) -> tuple[bytes, int]:
    """The header's JSON bytes and the size of the data after it."""
    with open_regular(path, "rb", what="safetensors file", follow_symlinks=follow_symlinks) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: {size} bytes, too short for a safetensors file: refused")
        (n,) = struct.unpack("<Q", head)
        if n > bounds.max_header_bytes or 8 + n > size:
            raise UserError(f"{path}: its safetensors header claims {n} bytes (file: {size} bytes; bound: "
                            f"{bounds.max_header_bytes}): damaged or crafted, refused before reading it")
        header = f.read(n)
    if len(header) != n:
        raise UserError(f"{path}: the file shrank while its header was read: refused")
    return header, size - 8 - n


def check_safetensors_header(path: str | os.PathLike, bounds: SafetensorsBounds = DEFAULT_BOUNDS, *,
                             follow_symlinks: bool = False) -> dict[str, Any]:
    """The header of the safetensors file `path` as a dict ({name: {dtype, shape, data_offsets}} and
    `__metadata__`: {str: str}), once every bound above holds; else a UserError naming the file.
    `follow_symlinks`: a link to a regular file is read (e.g. a hub cache's blob); off by default."""
    header_bytes, data_size = read_header_bytes(path, bounds, follow_symlinks)
    _check_counts(header_bytes, bounds, path)
    header = load_bounded(header_bytes, bounds.json_bounds(), f"{path}: safetensors header")
    if type(header) is not dict:
        raise UserError(f"{path}: its safetensors header is not a JSON object: refused")
    _check_metadata(header.get(METADATA, {}), path, bounds)
    entries = [(k, v) for k, v in header.items() if k != METADATA]
    if len(entries) > bounds.max_tensors:
        raise UserError(f"{path}: {len(entries)} tensors, over the bound of {bounds.max_tensors}: refused")
    ranges = sorted(_check_entry(name, entry, path, bounds) for name, entry in entries)
    end = 0
    for begin, stop in ranges:  # the format: the data is tiled by the tensors' ranges, in some order
        if begin != end:
            raise UserError(f"{path}: its tensors' byte ranges leave a gap or overlap at byte {min(begin, end)} of "
                            "the data: damaged or crafted, refused")
        end = stop
    if end != data_size:
        raise UserError(f"{path}: its tensors hold {end} bytes of data but the file has {data_size} after the "
                        "header: damaged (cut short?) or crafted, refused")
    return header


def _check_counts(header: bytes, bounds: SafetensorsBounds, path: Any) -> None:
    """What a parse of `header` could build, bounded before it starts. A header of n tensors holds about
    3 objects/arrays, 7 strings (14 quotes, DCP's escaped ones included) and 2 x dims + 5 commas per tensor;
    counting those bytes anywhere (inside strings too) over-counts, never under-counts the objects, strings
    and numbers json.loads would make."""
    n = bounds.max_tensors
    for char, limit in ((b"{", 3 * n + 16), (b"[", 3 * n + 16), (b'"', 16 * n + 64),
                        (b",", (5 + 2 * bounds.max_ndim) * n + 64)):
        if header.count(char) > limit:
            raise UserError(f"{path}: its safetensors header holds more than {limit} {char.decode()!r} characters, "
                            f"more than {n} tensors need: refused before parsing it")


def _check_metadata(meta: Any, path: Any, bounds: SafetensorsBounds) -> None:
    if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
        raise UserError(f"{path}: its safetensors {METADATA} must map names to strings: refused")
    for key, value in meta.items():
        if len(key) > bounds.max_name or len(value) > bounds.max_metadata_value:
            raise UserError(f"{path}: {METADATA} entry {key[:80]!r} is over the bound of {bounds.max_name} "
                            f"characters for a key or {bounds.max_metadata_value} for a value: refused")


def _check_entry(name: str, entry: Any, path: Any, bounds: SafetensorsBounds) -> tuple[int, int]:
    """The entry's byte range (relative to the data), once its dtype, shape and range are consistent."""
    shown = repr(name[:80])
    if len(name) > bounds.max_name:
        raise UserError(f"{path}: a tensor name of {len(name)} characters, over the bound of {bounds.max_name}")
    if type(entry) is not dict or set(entry) != ENTRY_KEYS or type(entry["dtype"]) is not str \
            or entry["dtype"] not in DTYPE_BYTES:  # (a list is unhashable: its type first)
        raise UserError(f"{path}: tensor {shown} is not a safetensors entry (dtype, shape, data_offsets) of a "
                        f"known dtype ({', '.join(DTYPE_BYTES)}): refused")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not is_dim_list(shape, bounds.max_ndim, bounds.max_dim):
        raise UserError(f"{path}: tensor {shown} has a shape that is not a list of at most {bounds.max_ndim} "
                        f"dimensions in [0, {bounds.max_dim}]: refused")
    numel = bounded_numel(shape, bounds.max_numel)
    if numel is None:
        raise UserError(f"{path}: tensor {shown} of shape {shape} has more than {bounds.max_numel} elements: refused")
    if not (is_dim_list(offsets, 2, 2**63) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise UserError(f"{path}: tensor {shown} has data_offsets that are not [begin, end]: refused")
    if offsets[1] - offsets[0] != numel * DTYPE_BYTES[entry["dtype"]]:
        raise UserError(f"{path}: tensor {shown} ({entry['dtype']} {shape}) needs "
                        f"{numel * DTYPE_BYTES[entry['dtype']]} bytes but its range holds {offsets[1] - offsets[0]}: "
                        "damaged or crafted, refused")
    return offsets[0], offsets[1]
