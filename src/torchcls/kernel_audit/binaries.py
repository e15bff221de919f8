"""What GPU code ships in compiled extensions (.so) and Triton kernels, read without CUDA tools.

A CUDA extension carries its device code in the ELF section `.nv_fatbin`: a sequence of
fat binaries (magic 0xBA55ED50), each holding entries of kind PTX (JIT-compiled by the
driver for newer GPUs) or cubin/ELF (machine code for one architecture family). The
entry header layout is the one documented by the open-source fatbin readers (e.g.
cuda-fatbin-decompression): kind u16 at 0, header size u32 at 4, padded payload size
u32 at 8, SM version u32 at 28. Parsing it ourselves avoids needing `cuobjdump`.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FATBIN_MAGIC = 0xBA55ED50
FATBIN_HEADER = 16  # magic u32, version u16, header size u16, payload size u64
ELF_SHDR = 64  # bytes of one ELF64 section header
KIND_PTX, KIND_CUBIN = 1, 2


@dataclass
class GpuBinary:
    path: str
    cubin_archs: list[int] = field(default_factory=list)  # e.g. 80 for sm_80
    ptx_archs: list[int] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sm": [f"sm_{a}" for a in self.cubin_archs],
                "ptx": [f"compute_{a}" for a in self.ptx_archs], "error": self.error}


def elf_section(path: Path, wanted: str) -> bytes | None:
    """The bytes of one section of a 64-bit little-endian ELF file (None when absent). Every offset and size the
    file gives is checked against the file's length before it is used (ValueError: damaged or crafted)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            return None
        shoff, = struct.unpack_from("<Q", ident, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
        if shentsize < ELF_SHDR or shoff + shentsize * shnum > size or shstrndx >= shnum:
            raise ValueError(f"section headers ({shnum} x {shentsize} bytes at {shoff}, names in {shstrndx}) do not "
                             f"fit the file's {size} bytes")
        f.seek(shoff)
        headers = [struct.unpack("<IIQQQQIIQQ", f.read(shentsize)[:ELF_SHDR]) for _ in range(shnum)]
        names_off, names_size = headers[shstrndx][4], headers[shstrndx][5]
        _check_range(names_off, names_size, size, "the section names")
        f.seek(names_off)
        names = f.read(names_size)
        for h in headers:
            name = names[h[0]:names.index(b"\0", h[0])].decode(errors="replace")
            if name == wanted:
                _check_range(h[4], h[5], size, wanted)
                f.seek(h[4])
                return f.read(h[5])
    return None


def _check_range(offset: int, length: int, size: int, what: str) -> None:
    if offset + length > size:
        raise ValueError(f"{what}: {length} bytes at {offset}, past the end of the file ({size} bytes)")


def parse_fatbin(blob: bytes) -> tuple[list[int], list[int]]:
    """(cubin archs, ptx archs) of every fat binary in a `.nv_fatbin` section. A fat binary whose header is
    shorter than one, or whose size runs past the section, is a ValueError: each step moves forward."""
    cubins, ptx = set(), set()
    pos = 0
    while pos + FATBIN_HEADER <= len(blob):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", blob, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned; skip padding between them
            continue
        entry, end = pos + header_size, pos + header_size + fat_size
        if header_size < FATBIN_HEADER or end > len(blob):
            raise ValueError(f"the fat binary at byte {pos} of .nv_fatbin claims a {header_size}-byte header and "
                             f"{fat_size} bytes (the section holds {len(blob)}): damaged or crafted")
        while entry + 32 <= end:
            kind, _v, entry_header, padded = struct.unpack_from("<HHII", blob, entry)
            sm, = struct.unpack_from("<I", blob, entry + 28)
            (ptx if kind == KIND_PTX else cubins).add(sm) if kind in (KIND_PTX, KIND_CUBIN) else None
            if entry_header == 0:
                break
            entry += entry_header + padded
        pos = end  # > pos: the header is at least FATBIN_HEADER bytes
    return sorted(cubins), sorted(ptx)


def scan_shared_object(path: Path) -> GpuBinary | None:
    """The GPU architectures a .so targets; None when it carries no device code."""
    try:
        section = elf_section(path, ".nv_fatbin")
        if section is None:
            return None
        cubins, ptx = parse_fatbin(section)
    except (OSError, struct.error, ValueError) as e:
        return GpuBinary(str(path), error=f"unreadable ELF: {e}")
    return GpuBinary(str(path), cubins, ptx)


def runs_on(binary: GpuBinary, capability: tuple[int, int]) -> tuple[bool, str]:
    """Can this binary run on a GPU of `capability`? Cubins run on the same major version at
    an equal or higher minor; PTX is JIT-compiled by the driver for any newer GPU."""
    major, minor = capability
    target = major * 10 + minor
    if any(a // 10 == major and a <= target for a in binary.cubin_archs):
        return True, f"native code for sm_{target}'s family"
    if any(a <= target for a in binary.ptx_archs):
        return True, "only via PTX JIT at first load (slow start); add the native arch to TORCH_CUDA_ARCH_LIST"
    return False, f"no code for sm_{target}: rebuild with TORCH_CUDA_ARCH_LIST including {major}.{minor}"


def shared_objects(package_dirs: list[Path], extra: list[str]) -> list[Path]:
    found = {Path(p).resolve() for p in extra}
    for d in package_dirs:
        found.update(p.resolve() for p in d.rglob("*.so*") if p.is_file())
    return sorted(found)


@dataclass
class TritonKernel:
    name: str
    module: str
    file: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "module": self.module, "file": self.file}


def triton_kernels(prefixes: list[str]) -> list[TritonKernel]:
    """`@triton.jit` / `@triton.autotune` kernels defined in imported modules under `prefixes`."""
    if "triton" not in sys.modules:
        return []  # nothing can define a Triton kernel without importing triton
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    kernels = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not any(mod_name == p or mod_name.startswith(p + ".") for p in prefixes):
            continue
        for attr, value in list(vars(mod).items()):
            fn = value.fn if isinstance(value, Autotuner) else value
            if isinstance(fn, JITFunction) and getattr(fn, "__module__", mod_name) == mod_name:
                kernels.append(TritonKernel(attr, mod_name, getattr(mod, "__file__", None)))
    return kernels
