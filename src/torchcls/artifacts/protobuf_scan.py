"""Counted before parsed: what a protobuf parse of some bytes would build, read from the wire format itself.

Parsing a protobuf builds one object for every message on the wire and one slot for every repeated element,
whatever their size there: an empty message is 2 bytes in a file and 55-200 bytes once parsed (upb, onnx
1.23), a 1-byte varint of a packed int64 field 8-16 bytes. So a file well inside a size bound can make the
parse itself allocate 80 times its size. `scan` walks the bytes with the message's descriptor (the schema
of the installed package, so it knows which length-delimited fields are messages) and counts, without
building anything:

- every field occurrence (messages, strings, scalars, unknown fields): `max_fields`; an element of a packed
  varint field is one occurrence (it takes 8 bytes or more parsed; packed fixed-width elements take what
  they take in the file, like a bytes field, and are not counted one by one);
- every message: `max_messages`, and per message type in `limits` (full name -> bound, noun);
- nesting: `max_depth` messages deep (protobuf's own parser stops at 100).

One pass, each byte looked at once at most (the contents of strings, bytes and packed fixed-width fields are
skipped by their length), and it stops at the first bound passed: its time grows with the bounds, not with
the file. Malformed wire data (a varint past 10 bytes, a length past the end of its message, groups, wire
types 6 and 7) is refused too, at the first byte that shows it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

_MESSAGE, _VARINT, _FIXED64, _FIXED32, _BYTES = range(5)
_UNKNOWN = (_BYTES, 2, False, None)  # an unknown field: kept as its bytes
_CHUNK = 1 << 20  # bytes of a packed varint field counted at a time (a temporary of that many bytes)


class ScanError(ValueError):
    """`malformed`: the bytes are not protobuf wire data at all; otherwise they would pass a bound."""

    def __init__(self, what: str, malformed: bool) -> None:
        super().__init__(what)
        self.malformed = malformed


@dataclass
class Counts:
    fields: int = 0
    messages: int = 0
    by_type: Counter = field(default_factory=Counter)  # occurrences of the message types in `limits`
    depth: int = 0  # deepest message (the outermost is 0)


@lru_cache(maxsize=None)
def _table(descriptor: Any) -> dict[int, tuple[int, int, bool, Any]]:
    """field number -> (kind, the wire type it comes as, repeated, message descriptor or None)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    fixed64 = {F.TYPE_DOUBLE, F.TYPE_FIXED64, F.TYPE_SFIXED64}
    fixed32 = {F.TYPE_FLOAT, F.TYPE_FIXED32, F.TYPE_SFIXED32}
    table = {}
    for number, f in descriptor.fields_by_number.items():
        if f.type in (F.TYPE_MESSAGE, F.TYPE_GROUP):
            kind, wire = _MESSAGE, 2 if f.type == F.TYPE_MESSAGE else 3
        elif f.type in (F.TYPE_STRING, F.TYPE_BYTES):
            kind, wire = _BYTES, 2
        elif f.type in fixed64:
            kind, wire = _FIXED64, 1
        elif f.type in fixed32:
            kind, wire = _FIXED32, 5
        else:  # int32/64, uint32/64, sint32/64, bool, enum
            kind, wire = _VARINT, 0
        repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == F.LABEL_REPEATED  # protobuf < 6
        table[number] = (kind, wire, repeated, f.message_type if kind == _MESSAGE else None)
    return table


def scan(data: bytes, descriptor: Any, *, max_fields: int, max_messages: int, max_depth: int,
         limits: dict[str, tuple[int, str]] | None = None) -> Counts:
    """Counts of what parsing `data` as a `descriptor` message would build; ScanError at the first bound
    passed or the first malformed byte. `limits`: message full name -> (bound, what to call them)."""
    counts = Counts()
    walk = _Scan(data, counts, max_fields, max_messages, max_depth, limits or {})
    walk.count_message(descriptor)
    walk.message(0, len(data), descriptor, 0)
    return counts


def _bound(what: str) -> ScanError:
    return ScanError(what, malformed=False)


class _Scan:
    def __init__(self, data: bytes, counts: Counts, max_fields: int, max_messages: int, max_depth: int,
                 limits: dict[str, tuple[int, str]]) -> None:
        self.data, self.counts = data, counts
        self.max_fields, self.max_messages, self.max_depth, self.limits = max_fields, max_messages, max_depth, limits

    def malformed(self, pos: int, what: str) -> ScanError:
        return ScanError(f"byte {pos}: {what}", malformed=True)

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        """The varint at `pos` (at most 10 bytes, within `end`) and the position after it."""
        data, value, shift, start = self.data, 0, 0, pos
        while True:
            if pos >= end:
                raise self.malformed(start, "a varint runs past the end of its message")
            if pos - start == 10:
                raise self.malformed(start, "a varint longer than 10 bytes")
            b = data[pos]
            value |= (b & 0x7F) << shift
            pos += 1
            if b < 0x80:
                return value, pos
            shift += 7

    def count_message(self, descriptor: Any) -> None:
        counts = self.counts
        counts.messages += 1
        if counts.messages > self.max_messages:
            raise _bound(f"it holds more than {self.max_messages} protobuf messages")
        name = descriptor.full_name
        if name in self.limits:
            counts.by_type[name] += 1
            bound, noun = self.limits[name]
            if counts.by_type[name] > bound:
                raise _bound(f"it has more than {bound} {noun}")

    def message(self, pos: int, end: int, descriptor: Any, depth: int) -> None:
        """Count what the message of type `descriptor` in data[pos:end] holds (the message itself is counted
        by its caller), recursing into the messages inside it."""
        counts, data = self.counts, self.data
        table, fields, max_fields = _table(descriptor), counts.fields, self.max_fields
        while pos < end:
            fields += 1
            if fields > max_fields:
                raise _bound(f"it holds more than {max_fields} protobuf fields")
            at = pos
            b = data[pos]
            if b < 0x80:
                tag, pos = b, pos + 1
            else:
                tag, pos = self.varint(pos, end)
            number, wire = tag >> 3, tag & 7
            if number == 0 or tag >> 32:
                raise self.malformed(at, f"field number {number}")
            if wire == 0:
                if pos < end and data[pos] < 0x80:
                    pos += 1
                else:
                    _, pos = self.varint(pos, end)
                continue
            if wire == 1 or wire == 5:
                pos += 8 if wire == 1 else 4
                if pos > end:
                    raise self.malformed(at, "a fixed-width field runs past the end of its message")
                continue
            if wire != 2:  # groups (3, 4: ONNX has none) and the wire types no encoder writes (6, 7)
                raise self.malformed(at, f"wire type {wire}")
            if pos < end and data[pos] < 0x80:
                length, pos = data[pos], pos + 1
            else:
                length, pos = self.varint(pos, end)
            if length > end - pos:
                raise self.malformed(at, f"a length of {length} bytes runs past the end of its message")
            start, pos = pos, pos + length
            kind, want, repeated, sub = table.get(number, _UNKNOWN)
            if kind == _MESSAGE and want == 2:
                if depth >= self.max_depth:
                    raise _bound(f"its messages nest deeper than {self.max_depth}")
                counts.depth = max(counts.depth, depth + 1)
                self.count_message(sub)
                if length:
                    counts.fields = fields
                    self.message(start, pos, sub, depth + 1)
                    fields = counts.fields
            elif kind == _VARINT and repeated and length:
                fields += self.packed_varints(start, pos, max_fields - fields + 1) - 1
            # anything else that is length-delimited (strings, bytes, packed fixed-width elements, unknown
            # fields, a field on the wire type of none of its encodings): as many bytes parsed as in the file
        counts.fields = fields

    def packed_varints(self, start: int, end: int, room: int) -> int:
        """How many varints data[start:end] holds (its bytes below 0x80); over `room`, a ScanError."""
        if (end - start + 9) // 10 > room:  # each varint is at most 10 bytes: at least this many
            raise _bound(f"it holds more than {self.max_fields} protobuf fields")
        if self.data[end - 1] >= 0x80:
            raise self.malformed(end - 1, "a packed varint runs past the end of its field")
        import numpy as np

        n = 0
        for a in range(start, end, _CHUNK):
            n += int(np.count_nonzero(np.frombuffer(self.data, np.uint8, min(_CHUNK, end - a), a) < 0x80))
        if n > room:
            raise _bound(f"it holds more than {self.max_fields} protobuf fields")
        return n
