"""Tar header chains checked before `tarfile` parses them (shards.py opens and walks every shard through this).

One pass over each member's header chain, before tarfile parses it: tarfile reads an extension header's
whole declared size (a GNU long name declaring 2^40 bytes: read(2^40), a MemoryError), searches pax headers
with regexes quadratic in their length (CVE-2024-6232 in Python < 3.11.10: 32 KiB of digits took 1 s), and
chains extension headers by recursion. Shard writers (torchcls, webdataset,
tarfile, GNU tar) write at most a pax header (a long or non-ASCII name, a float mtime: tens of bytes to a few
KiB) or a GNU long name and link name before a member, and never a sparse member.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import BinaryIO

from torchcls.errors import UserError

MAX_TAR_EXTENSION_BYTES = 64 << 10  # one pax or GNU long-name header's data (a path is at most 4 KiB)
MAX_TAR_EXTENSIONS = 8  # extension headers before one member (real tars: at most 3: a first 'g', then 'x' or 'L' + 'K')
# The longest run of digits in a pax header (its numbers have at most 20): long runs make tarfile's regex quadratic
MAX_PAX_DIGITS = 32
# Records in one pax header: tarfile keeps each member's records (a dict) as long as the TarFile, and applies the
# global ones ('g', allowed only as the archive's first header, as git archive writes it) to every member after.
# Real ones hold a path, times, ids, names and a few xattrs.
MAX_PAX_RECORDS = 32
# A pax 'size' record replaces the member's header size, and tarfile moves its offset by it (int(value): '-1536'
# moved it back to byte 0, so the same member was parsed forever; '-1' made a reader's f.read(-1) read the rest of
# the shard). Of the pax keys tarfile applies (path, linkpath, size, mtime, uid, gid, uname, gname), only `size`
# moves an offset or sizes a read (the GNU.sparse.* keys do too: refused above). Its value is held to what a
# header's size field is: a non-negative decimal integer of at most MAX_PAX_SIZE_DIGITS digits, the member's data
# inside the file.
MAX_PAX_SIZE_DIGITS = 20  # 2^64 has 20 digits
_PAX_SIZE = re.compile(rb"\d{1,%d}" % MAX_PAX_SIZE_DIGITS)
_EXTENSIONS = {b"x": "pax extended header ('x')", b"X": "Solaris pax header ('X')", b"g": "pax global header ('g')",
               b"L": "GNU long-name header ('L')", b"K": "GNU long-link-name header ('K')"}
_PAX_DIGIT_RUN = re.compile(rb"\d{%d}" % (MAX_PAX_DIGITS + 1))
_BLOCK = 512  # tar's block: every header is one, every member's data is padded to a multiple


def check_member_headers(f: BinaryIO, offset: int, file_size: int, shard: Path | str) -> None:
    """Check the header chain at `offset` (extension headers, then the member they describe) as tarfile would read
    it, without tarfile: every declared size within the file, extension headers few and small and pax records
    well formed, no sparse member. UserError naming the shard and the header's byte otherwise; the file's
    position is left anywhere (tarfile seeks to where it reads)."""
    start, pax_sizes = offset, []  # (a pax header's byte and kind, the size its 'size' record gives the member)
    for _ in range(MAX_TAR_EXTENSIONS + 1):
        f.seek(offset)
        header = f.read(_BLOCK)
        size = _header_size(header)
        if size is None:  # no header here: the end-of-archive zeros, a cut, or a block tarfile refuses itself
            return
        kind, where = header[156:157], f"shard {shard}: the tar header at byte {offset:,}"
        name = header[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        if size < 0 or offset + _BLOCK + size > file_size:
            beyond = "a negative size" if size < 0 else f"past the end of the {file_size:,}-byte file"
            raise UserError(f"{where} (member {name!r}) declares {size:,} bytes, {beyond}: it is truncated or not a "
                            "shard. Re-copy or re-write it (torchcls data shard)")
        if kind == b"S":
            raise UserError(f"{where} is a GNU sparse member ('S'), which no shard writer makes and tarfile would "
                            "follow through chained blocks; re-write the shard (torchcls data shard)")
        if kind not in _EXTENSIONS:
            for at, pax_kind, pax_size in pax_sizes:  # tarfile gives the member the size of its pax header(s)
                if offset + _BLOCK + pax_size > file_size:
                    raise UserError(f"shard {shard}: the tar header at byte {at:,} is a {_EXTENSIONS[pax_kind]} whose "
                                    f"'size' record gives member {name!r} (at byte {offset:,}) {pax_size:,} bytes, "
                                    f"past the end of the {file_size:,}-byte file: it is truncated or not a shard. "
                                    "Re-copy or re-write it (torchcls data shard)")
            return
        if size > MAX_TAR_EXTENSION_BYTES:
            raise UserError(f"{where} is a {_EXTENSIONS[kind]} of {size:,} bytes, more than the "
                            f"{MAX_TAR_EXTENSION_BYTES:,} read (tar_headers.MAX_TAR_EXTENSION_BYTES; real ones hold a "
                            "name of a few KiB at most); re-write the shard (torchcls data shard)")
        if kind == b"g" and offset:
            raise UserError(f"{where} is a {_EXTENSIONS[kind]} after the first member (its records would apply to "
                            "every member after it; writers put one first, if any); re-write the shard "
                            "(torchcls data shard)")
        if kind in b"xXg":
            padded, sizes = -(-size // _BLOCK) * _BLOCK, []
            problem = _pax_problem(f.read(padded), size, sizes)
            if not problem and sizes and kind == b"g":
                problem = "a 'size' record (tarfile would give every member after it that size)"
            if problem:
                raise UserError(f"{where} is a {_EXTENSIONS[kind]} with {problem}; tar writers make none such. "
                                "Re-write the shard (torchcls data shard)")
            pax_sizes += [(offset, kind, n) for n in sizes]
        offset += _BLOCK + -(-size // _BLOCK) * _BLOCK
    raise UserError(f"shard {shard}: the tar header at byte {start:,} begins more than {MAX_TAR_EXTENSIONS} "
                    "extension headers in a row (tar_headers.MAX_TAR_EXTENSIONS; tar writers put at most 3 before a "
                    "member); re-write the shard (torchcls data shard)")


def _header_size(header: bytes) -> int | None:
    """The size a 512-byte block declares if tarfile would take it for a header (its checksum, computed unsigned
    or signed as tarfile does, matches), else None."""
    if len(header) < _BLOCK or not header.strip(b"\0"):
        return None
    stored, size = _tar_number(header[148:156]), _tar_number(header[124:136])
    unsigned = 256 + sum(header[:148]) + sum(header[156:])  # (the checksum field itself counts as 8 spaces)
    high = len(header[:148].translate(None, bytes(range(128)))) + len(header[156:].translate(None, bytes(range(128))))
    if stored is None or stored not in (unsigned, unsigned - 256 * high) or size is None:
        return None
    return size


def _tar_number(field: bytes) -> int | None:
    """A header number exactly as tarfile reads one (octal text up to a NUL, or GNU base-256); None where tarfile
    finds it invalid."""
    if field[0] in (0o200, 0o377):
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    try:
        return int(field.split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except ValueError:
        return None


def _pax_problem(block: bytes, size: int, sizes: list[int]) -> str:
    """What is wrong with a pax header's data ('' if nothing), in one linear pass: its records ("LEN KEY=VALUE\\n")
    must tile its size exactly, be at most MAX_PAX_RECORDS, and its padding be zeros (tarfile parses on into the
    padding); no GNU sparse keys, no run of digits longer than MAX_PAX_DIGITS, and a `size` record's value a
    non-negative decimal of at most MAX_PAX_SIZE_DIGITS digits (appended to `sizes`)."""
    data, pos, records = block[:size], 0, 0
    if block[size:].strip(b"\0"):
        return "data in its padding"
    while pos < size:
        records += 1
        if records > MAX_PAX_RECORDS:
            return f"more than {MAX_PAX_RECORDS} records (tar_headers.MAX_PAX_RECORDS)"
        space = data.find(b" ", pos, pos + 12)
        if space <= pos or not data[pos:space].isdigit():
            return f"a malformed record at byte {pos:,} of its data"
        end = pos + int(data[pos:space])
        equals = data.find(b"=", space + 1, end - 1)
        if end > size or equals <= space + 1 or data[end - 1:end] != b"\n":
            return f"a malformed record at byte {pos:,} of its data"
        if data[space + 1:equals].startswith(b"GNU.sparse."):
            return "GNU sparse keys (no shard writer makes a sparse member)"
        if data[space + 1:equals] == b"size":
            value = data[equals + 1:end - 1]
            if not _PAX_SIZE.fullmatch(value):
                shown = value[:24].decode("ascii", "replace") + ("..." if len(value) > 24 else "")
                return (f"a 'size' record of {shown!r}, not a non-negative decimal of at most {MAX_PAX_SIZE_DIGITS} "
                        "digits (tar_headers.MAX_PAX_SIZE_DIGITS)")
            sizes.append(int(value))
        pos = end
    if _PAX_DIGIT_RUN.search(data):
        return f"a run of more than {MAX_PAX_DIGITS} digits"
    return ""
