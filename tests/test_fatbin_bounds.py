"""The kernel audit reads a .so's `.nv_fatbin` itself: every size and offset the file gives is checked against the
bytes there are, and every step of the fat-binary walk moves forward (a zero-size header looped forever)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from torchcls.kernel_audit.binaries import FATBIN_MAGIC, KIND_CUBIN, KIND_PTX, parse_fatbin, scan_shared_object


def _entry(kind: int, sm: int, payload: int = 16) -> bytes:
    header = struct.pack("<HHII", kind, 0, 64, payload) + bytes(16) + struct.pack("<I", sm) + bytes(32)
    return header + bytes(payload)


def _fatbin(*entries: bytes, header_size: int = 16, fat_size: int | None = None) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, header_size, len(body) if fat_size is None else fat_size) + body


def _elf(sections: dict[str, bytes], shoff: int | None = None, size_of: dict[str, int] | None = None) -> bytes:
    """A 64-bit little-endian ELF holding `sections` (and .shstrtab), section headers at the end."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    datas, offset, headers = b"", 64, [bytes(64)]
    for name, data in [*sections.items(), (".shstrtab", names)]:
        size = (size_of or {}).get(name, len(data))
        headers.append(struct.pack("<IIQQQQIIQQ", names.index(name.encode() + b"\0"), 1, 0, 0, offset + len(datas),
                                   size, 0, 0, 1, 0))
        datas += data
    table = 64 + len(datas)
    ident = bytearray(64)
    ident[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", ident, 0x28, table if shoff is None else shoff)
    struct.pack_into("<HHH", ident, 0x3A, 64, len(headers), len(headers) - 1)
    return bytes(ident) + datas + b"".join(headers)


def test_a_fat_binary_is_read_as_before():
    blob = _fatbin(_entry(KIND_CUBIN, 80), _entry(KIND_PTX, 90)) + bytes(8) + _fatbin(_entry(KIND_CUBIN, 86))
    assert parse_fatbin(blob) == ([80, 86], [90])


@pytest.mark.parametrize(("blob", "message"), [
    (struct.pack("<IHHQ", FATBIN_MAGIC, 1, 0, 0), "a 0-byte header"),  # the reproducer: `pos = end` never moved
    (_fatbin(_entry(KIND_CUBIN, 80), fat_size=1 << 62), "the section holds"),
    (_fatbin(_entry(KIND_CUBIN, 80), header_size=8), "a 8-byte header")])
def test_a_fat_binary_that_would_not_advance_or_runs_past_its_section_is_refused(blob, message):
    with pytest.raises(ValueError, match=message):
        parse_fatbin(blob)


def test_elf_sizes_are_bounded_by_the_file(tmp_path: Path):
    fatbin = _fatbin(_entry(KIND_CUBIN, 90))
    good = tmp_path / "good.so"
    good.write_bytes(_elf({".text": b"\x90" * 8, ".nv_fatbin": fatbin}))
    found = scan_shared_object(good)
    assert (found.cubin_archs, found.ptx_archs, found.error) == ([90], [], None)
    (tmp_path / "none.so").write_bytes(_elf({".text": b"\x90" * 8}))
    assert scan_shared_object(tmp_path / "none.so") is None
    for name, data, message in (
            ("far.so", _elf({".nv_fatbin": fatbin}, size_of={".nv_fatbin": 1 << 62}), ".nv_fatbin: .* past the end"),
            ("names.so", _elf({".nv_fatbin": fatbin}, size_of={".shstrtab": 1 << 40}), "section names"),
            ("table.so", _elf({".nv_fatbin": fatbin}, shoff=1 << 50), "do not fit the file"),
            ("loop.so", _elf({".nv_fatbin": struct.pack("<IHHQ", FATBIN_MAGIC, 1, 0, 0)}), "0-byte header")):
        (tmp_path / name).write_bytes(data)
        found = scan_shared_object(tmp_path / name)
        assert found.error is not None and found.error.startswith("unreadable ELF: ")
        assert re.search(message, found.error), found.error
