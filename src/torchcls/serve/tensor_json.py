"""An OIP infer request's JSON, parsed at a cost bounded by the declared shape, not by the body.

A JSON parser builds every nested list it meets: 31 MiB of `[],[],...` as `data` cost 21 s of CPU
and 1.9 GB in orjson before any shape was checked. Here the `data` arrays are cut out of the raw
bytes first (C-speed searches and counts, no object built), the rest of the request, at most
MAX_ENVELOPE bytes, is parsed, and only then, once `shape` and `datatype` are checked, is the one
`data` array parsed, after its raw bytes passed what the shape allows: exactly prod(shape) - 1
commas (a tree with n leaves, however nested, has n - 1), no more `[` than a fully nested array of
that shape has, and at most MAX_CHARS_PER_VALUE bytes a value.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson

from torchcls.serve.http_errors import HTTPError

MAX_ENVELOPE = 64 * 1024  # bytes of request JSON outside the data arrays: names, shape, outputs, parameters
MAX_QUOTES = 4096  # '"' in a whole request: a few dozen strings are plenty for one FP32 input
MAX_CHARS_PER_VALUE = 64  # '-1.2345678901234567e-308, ' with pretty-printing room
_DATA_KEY = re.compile(rb'"data"\s*:\s*(?=\[)')
_PLACEHOLDER = "\x00torchcls-data-"


def _array_end(text: bytes | bytearray, start: int) -> int:
    """End of the numeric array at `start`, or -1: it ends at its last ']' before the next '"', '{' or '}'
    (a data array of numbers holds none of them) and must hold as many '[' as ']'."""
    stop = len(text)
    for stopper in (b'"', b"{", b"}"):
        i = text.find(stopper, start, stop)
        if i >= 0:
            stop = i
    end = text.rfind(b"]", start, stop) + 1
    if end <= start or text.count(b"[", start, end) != text.count(b"]", start, end):
        return -1
    return end


def load_request(text: bytes | bytearray) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """The request JSON with each `"data": [...]` array of numbers replaced by a placeholder string, and
    each placeholder's byte span in `text`; any fault is an HTTPError 400."""
    if text.count(b'"') > MAX_QUOTES:
        raise HTTPError(400, f"the request JSON holds more than {MAX_QUOTES // 2} strings; send one FP32 input "
                             "with numbers as 'data'")
    pieces: list[bytes] = []
    spans: dict[str, tuple[int, int]] = {}
    size, pos = 0, 0
    for match in _DATA_KEY.finditer(text):
        start = match.end()
        if start < pos:
            continue
        end = _array_end(text, start)
        if end < 0:
            continue  # not an array of numbers: it stays in the envelope, bounded by MAX_ENVELOPE
        key = f"{_PLACEHOLDER}{len(spans)}"
        placeholder = orjson.dumps(key)
        pieces += [bytes(text[pos:start]), placeholder]
        size += start - pos + len(placeholder)
        spans[key] = (start, end)
        pos = end
    size += len(text) - pos
    if size > MAX_ENVELOPE:
        raise HTTPError(400, f"the request JSON outside input 'data' is {size:,} bytes; at most {MAX_ENVELOPE:,} "
                             "are accepted (names, shape, outputs, parameters)")
    pieces.append(bytes(text[pos:]))
    try:
        request = orjson.loads(b"".join(pieces))
    except orjson.JSONDecodeError as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(request, dict):
        raise HTTPError(400, "the request body must be a JSON object with an 'inputs' list")
    return request, spans


def parse_data(text: bytes | bytearray, spans: dict[str, tuple[int, int]], data: Any,
               shape: list[int]) -> np.ndarray | None:
    """The input's `data` as a flat float32 array when load_request cut it out (None otherwise), checked
    against `shape` on its raw bytes before it is parsed."""
    if not isinstance(data, str) or data not in spans:
        return None
    start, end = spans[data]
    count = int(np.prod(shape))
    values = text.count(b",", start, end) + 1
    if values != count:
        raise HTTPError(400, f"input 'data' has {values} values; shape {shape} requires {count}")
    most_lists = 1 + sum(int(np.prod(shape[:i])) for i in range(1, len(shape)))  # fully nested
    if text.count(b"[", start, end) > most_lists:
        raise HTTPError(400, f"input 'data' holds more nested lists than shape {shape} has (at most {most_lists})")
    if end - start > MAX_CHARS_PER_VALUE * count + 2 * most_lists:
        raise HTTPError(400, f"input 'data' is {end - start:,} bytes, more than {count} numbers need")
    try:
        parsed = orjson.loads(memoryview(text)[start:end])
        return np.array(parsed, dtype=np.float32).reshape(-1)  # straight to float32: the cheapest path
    except orjson.JSONDecodeError as e:
        raise HTTPError(400, f"input 'data' is not a valid JSON array: {e}") from None
    except (ValueError, TypeError) as e:  # ragged nesting, objects
        raise HTTPError(400, f"input 'data' must be a regular array of numbers: {e}") from None
