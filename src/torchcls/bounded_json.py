"""JSON from a file, parsed only under bounds stated before the parse.

`json.loads` builds every object a text describes: a megabyte of `[[],[],...]` is half a million
lists, and a text nested deeper than the interpreter's recursion limit ends in a RecursionError.
Here the size is bounded first, then the number of values the text can describe (every `{`, `[`
and `,` byte counted, those inside strings too: an over-count, never an under-count), so the
objects a parse can build are bounded before it starts; a number too large for a float (1e999)
is refused as it is parsed; after the parse, the number of values, the nesting and the length of
every string (keys included) are checked, a string that is not Unicode text (a lone surrogate,
which JSON's \ud800 escapes can spell and which no later encode survives) is refused, and a key
given twice in one object is refused. Every refusal is a UserError naming the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from torchcls.errors import UserError
from torchcls.io_files import read_bytes


@dataclass(frozen=True)
class JsonBounds:
    max_bytes: int  # the text's size
    max_values: int  # values of every kind (objects, arrays, strings, numbers...; keys not counted)
    max_depth: int  # nesting of objects and arrays
    max_str: int  # characters of one string (keys included)
    allow_nonfinite: bool = False  # NaN / Infinity (Python's json writes them for non-finite floats)


def _pairs(where: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise UserError(f"{where}: key {dup[:80]!r} appears twice in one JSON object: refused (damaged or "
                            "crafted; a reader could take either value)")
        return out
    return hook


def _no_constant(where: str):
    def refuse(name: str) -> float:
        raise UserError(f"{where}: {name} is not a number this file may hold: refused")
    return refuse


def _finite(where: str):
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise UserError(f"{where}: the number {text[:40]} does not fit a float: refused")
        return value
    return parse


def _unicode(text: str, what: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{where}: a {what} that is not Unicode text (a lone surrogate escape): refused") from None


class NotJson(UserError):
    """The bytes are not JSON at all (a write cut short, another format), as against JSON past a bound: readers
    that take a damaged record as absent catch this one only."""


def load_bounded(text: str | bytes, bounds: JsonBounds, where: str) -> Any:
    """Parse `text` (the JSON of `where`) under `bounds`: NotJson when it does not parse, UserError past a bound."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    if len(raw) > bounds.max_bytes:
        raise UserError(f"{where}: {len(raw)} bytes of JSON, over the bound of {bounds.max_bytes}: refused")
    values = raw.count(b"{") + raw.count(b"[") + raw.count(b",") + 1
    if values > bounds.max_values:
        raise UserError(f"{where}: up to {values} JSON values, over the bound of {bounds.max_values}: refused "
                        "before parsing")
    try:
        value = json.loads(raw, object_pairs_hook=_pairs(where),
                           parse_constant=None if bounds.allow_nonfinite else _no_constant(where),
                           parse_float=None if bounds.allow_nonfinite else _finite(where))
    except (ValueError, RecursionError) as e:  # also UnicodeDecodeError and ints over Python's digit limit
        error = NotJson if isinstance(e, ValueError) else UserError  # (nested past the interpreter's depth)
        raise error(f"{where}: not valid JSON within bounds ({type(e).__name__}: "
                    f"{repr(str(e)[:160])[1:-1]}): refused") from None
    _check_shape(value, where, bounds)
    return value


def _check_shape(value: Any, where: str, bounds: JsonBounds) -> None:
    stack, count = [(value, 1)], 0
    while stack:  # iterative: the depth is what is being bounded
        node, depth = stack.pop()
        count += 1
        if count > bounds.max_values:
            raise UserError(f"{where}: more than {bounds.max_values} JSON values: refused")
        if isinstance(node, str):
            if len(node) > bounds.max_str:
                raise UserError(f"{where}: a string of {len(node)} characters, over the bound of {bounds.max_str}: "
                                "refused")
            _unicode(node, "string", where)
        if isinstance(node, (dict, list)):
            if depth > bounds.max_depth:
                raise UserError(f"{where}: JSON nested deeper than {bounds.max_depth} levels: refused")
            if isinstance(node, dict):
                long_key = next((k for k in node if len(k) > bounds.max_str), None)
                if long_key is not None:
                    raise UserError(f"{where}: a key of {len(long_key)} characters, over the bound of "
                                    f"{bounds.max_str}: refused")
                for key in node:
                    _unicode(key, "key", where)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def read_bounded(path: str | os.PathLike, bounds: JsonBounds, *, what: str = "JSON file",
                 follow_symlinks: bool = False) -> Any:
    """The JSON of the regular file `path` (opened without blocking, its size checked before reading)."""
    data = read_bytes(path, max_bytes=bounds.max_bytes, what=what, follow_symlinks=follow_symlinks)
    return load_bounded(data, bounds, str(path))
