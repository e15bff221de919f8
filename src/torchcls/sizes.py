"""Sizes written as text ('1GB', '512MiB', '1.5 g'): the one parser of every option that takes one
(`data shard --shard-size`, `bench-memory --device-memory` and `--overhead`)."""

from __future__ import annotations

import re
from decimal import Decimal

from torchcls.errors import UserError

# Decimal units (kB, MB, ...) are powers of 1000; binary ones (KiB, MiB, ...) and the bare letters (k, m, g, t, as
# free and nvidia-smi write them) powers of 1024.
UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
         "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
# At most 18 digits either side of the point, spaces and tabs around: the number is read exactly (Decimal), so no
# size is rounded through a float, and none of 310 digits becomes inf.
_SIZE = re.compile(r"[ \t]*([0-9]{0,18}\.?[0-9]{1,18})[ \t]*([a-zA-Z]*)[ \t]*")


def parse_size(text: str, option: str, max_bytes: int, max_name: str, examples: str, zero: bool = False) -> int:
    """`text` in bytes, at most `max_bytes` (named `max_name` in the message) and above 0 unless `zero`; else a
    UserError naming `option`, the text (cut to 40 characters) and `examples` of what it takes."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    size = int(Decimal(m.group(1)) * UNITS[unit]) if unit in UNITS else None  # whole bytes, checked as returned
    shown = text if len(text) <= 40 else f"{text[:30]}... ({len(text):,} characters)"
    if size is None:
        raise UserError(f"{option} {shown!r}: cannot read it as a size (a number of at most 18 digits and a unit); "
                        f"write e.g. {examples}")
    if not (0 <= size if zero else 0 < size) or size > max_bytes:
        raise UserError(f"{option} {shown!r} is {size:,} bytes: give a size from {'0' if zero else '1 byte'} up to "
                        f"{max_name}, such as {examples}")
    return size
