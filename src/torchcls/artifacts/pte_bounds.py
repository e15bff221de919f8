"""Bounded before built, for `.pte` programs: the memory a program makes the ExecuTorch runtime allocate is
read from the file and checked before the runtime is given it.

The runtime allocates a program's memory-planned buffers (`ExecutionPlan.non_const_buffer_sizes`; the
host-only methods share arenas sized to the largest) when it loads the program, and copies a method's
outputs out on every call. A 2.7 KB program planning 2 GiB for `forward` took 2 GB inside
`load_program`; a 2 KB one whose metadata method returned zeros(2^26) took 1.45 GB before its metadata
was read. The runtime's Python API does not expose the planned sizes, so `read_plans` reads them, with
each method's input shapes, from the program's flatbuffer (program.fbs), every offset checked against the
bytes it was given; `check_plans` bounds them before `load_program`, `check_outputs` bounds the output
sizes (`MethodMeta`) before a method runs.

Not covered: the sizes inside a delegate's payload (XNNPACK's own graph), which its runtime works out
when a method first runs (docs/security.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls.artifacts.sizes import value_bound
from torchcls.errors import UserError

MAX_PTE_BYTES = 2**32  # a whole program, read once (weights included: resnet50 in fp32 is ~100 MB)
MAX_PLANNED_BYTES = 2**32  # the memory `forward` may plan, whatever its input
MAX_METHODS = 16  # execution plans read from the flatbuffer (a torchcls program has two)
_ROOT_ID = b"ET12"  # the flatbuffer file identifier of the program format this runtime reads
# Field numbers in program.fbs: Program.execution_plan; ExecutionPlan name, values, inputs,
# non_const_buffer_sizes, non_const_buffer_device; EValue val (a union: type, then value); Tensor.
_PLANS, _NAME, _VALUES, _INPUTS, _SIZES, _DEVICES = 1, 0, 2, 3, 8, 9
_TENSOR = 5  # KernelTypes.Tensor
_BYTE, _FLOAT = 0, 6  # ScalarType codes (also what MethodMeta's TensorInfo.dtype() says)


@dataclass(frozen=True)
class Plan:
    """What loading one method costs: its planned bytes, whether any is off the CPU, its inputs."""

    planned: int
    off_cpu: bool
    inputs: tuple[tuple[int, tuple[int, ...]], ...]  # (scalar type, sizes) per input; (-1, ()) if not a tensor


class _Flat:
    """The few flatbuffer reads a Program needs, each one refused unless it lies inside `buf`."""

    def __init__(self, buf: bytes, path: Path):
        self.buf, self.path = buf, path

    def bad(self, what: str) -> UserError:
        return UserError(f"{self.path} is not a loadable ExecuTorch program ({what}); export one with "
                         "`torchcls export CHECKPOINT --target executorch`")

    def u(self, fmt: str, pos: int) -> int:
        size = struct.calcsize(fmt)
        if not 0 <= pos <= len(self.buf) - size:
            raise self.bad(f"an offset points outside the program's {len(self.buf)} bytes")
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def field(self, table: int, number: int) -> int:
        """Where field `number` of the table at `table` lies, or 0 when absent."""
        vtable = table - self.u("<i", table)
        if 4 + 2 * number + 2 > self.u("<H", vtable):
            return 0
        at = self.u("<H", vtable + 4 + 2 * number)
        return table + at if at else 0

    def ref(self, table: int, number: int) -> int:
        """The table, vector or string that an offset field points to (0 when absent)."""
        at = self.field(table, number)
        return at + self.u("<I", at) if at else 0

    def vector(self, table: int, number: int, item: int, most: int) -> tuple[int, int]:
        """(first element, count) of a vector field whose elements take `item` bytes each."""
        at = self.ref(table, number)
        if not at:
            return 0, 0
        count = self.u("<I", at)
        if count > most or at + 4 + count * item > len(self.buf):
            raise self.bad(f"a vector of {count} elements does not fit")
        return at + 4, count

    def tables(self, table: int, number: int, most: int) -> list[int]:
        start, n = self.vector(table, number, 4, most)
        return [start + 4 * i + self.u("<I", start + 4 * i) for i in range(n)]

    def scalars(self, table: int, number: int, fmt: str, most: int) -> list[int]:
        start, n = self.vector(table, number, struct.calcsize(fmt), most)
        return [self.u(fmt, start + struct.calcsize(fmt) * i) for i in range(n)]


def read_plans(data: bytes, path: Path) -> dict[str, Plan]:
    """Each method's Plan, read from the program's flatbuffer without the runtime."""
    flat = _Flat(data, path)
    if data[4:8] != _ROOT_ID:
        raise flat.bad(f"its file identifier is {data[4:8]!r}, not {_ROOT_ID!r}")
    if data[8:12] == b"eh00":  # the extended header: the flatbuffer is the first program_size bytes
        flat.buf = data[:max(0, min(flat.u("<Q", 16), len(data)))]
    plans = {}
    for plan in flat.tables(flat.u("<I", 0), _PLANS, MAX_METHODS):
        planned = flat.scalars(plan, _SIZES, "<q", 4096)
        if any(p < 0 for p in planned):
            raise flat.bad("a planned buffer has a negative size")
        off_cpu = any(flat.u("<b", at) != 0 for device in flat.tables(plan, _DEVICES, 4096)
                      if (at := flat.field(device, 1)))  # NonConstBufferDevice.device_type (absent: CPU)
        name_at, n = flat.vector(plan, _NAME, 1, 256)
        values, count = flat.vector(plan, _VALUES, 4, 10**7)
        inputs = tuple(_tensor(flat, values, count, i) for i in flat.scalars(plan, _INPUTS, "<i", 16))
        plans[flat.buf[name_at:name_at + n].decode("utf-8", "replace")] = Plan(sum(planned), off_cpu, inputs)
    return plans


def _tensor(flat: _Flat, values: int, count: int, index: int) -> tuple[int, tuple[int, ...]]:
    """(scalar type, sizes) of EValue `index` when it is a tensor, else (-1, ())."""
    if not 0 <= index < count:
        raise flat.bad(f"an input names value {index} of {count}")
    value = values + 4 * index + flat.u("<I", values + 4 * index)
    kind_at = flat.field(value, 0)
    if not kind_at or flat.u("<B", kind_at) != _TENSOR or not (tensor := flat.ref(value, 1)):
        return -1, ()
    kind_at = flat.field(tensor, 0)
    return (flat.u("<b", kind_at) if kind_at else 0), tuple(flat.scalars(tensor, 2, "<i", 16))


def check_plans(plans: dict[str, Plan], meta_method: str, largest: tuple[int, ...], path: Path) -> tuple[int, ...]:
    """Before the runtime sees the program: it has `forward` and the metadata method and nothing else, all on
    the CPU; the metadata method takes nothing and plans ≤ 8 MiB; `forward` takes one float32 batch of
    images of at most `largest` (what any valid metadata may say) and plans ≤ `forward_bound` of it.
    Returns forward's input shape."""
    from torchcls.checkpoint.meta_check import META_BOUNDS

    if set(plans) != {"forward", meta_method}:
        raise _refuse(path, f"it has methods {sorted(plans)} (a torchcls program has 'forward' and "
                            f"'{meta_method}')")
    if any(p.off_cpu for p in plans.values()):
        raise _refuse(path, "it places memory-planned buffers on an accelerator (this loader runs on the CPU)")
    meta, fwd = plans[meta_method], plans["forward"]
    if meta.inputs or meta.planned > META_BOUNDS.max_bytes:
        raise _refuse(path, f"its metadata method takes inputs or plans {meta.planned} bytes (at most "
                            f"{META_BOUNDS.max_bytes})")
    dtype, shape = fwd.inputs[0] if len(fwd.inputs) == 1 else (-1, ())
    if dtype != _FLOAT or len(shape) != 4 or not all(1 <= d <= most for d, most in zip(shape, largest)):
        raise _refuse(path, f"its forward method does not take one float32 batch of images of at most "
                            f"{list(largest)} (it takes {[list(s) for _, s in fwd.inputs][:4]})")
    if fwd.planned > forward_bound(shape):
        raise _refuse(path, f"its forward method plans {fwd.planned} bytes of memory, more than the "
                            f"{forward_bound(shape)} allowed for inputs of {list(shape)}")
    return shape


def check_outputs(program: Any, meta_method: str, shape: tuple[int, ...], path: Path) -> None:
    """Before a method runs (its outputs are copied out on each call): the metadata method returns one
    byte tensor of ≤ 8 MiB, `forward` at most two outputs, each within `forward_bound`."""
    from torchcls.checkpoint.meta_check import META_BOUNDS

    meta = program.metadata(meta_method)
    out = meta.output_tensor_meta(0) if meta.num_outputs() == 1 else None
    if out is None or out.dtype() != _BYTE or out.nbytes() > META_BOUNDS.max_bytes:
        raise _refuse(path, f"its metadata method does not return one tensor of at most {META_BOUNDS.max_bytes} "
                            "bytes")
    fwd = program.metadata("forward")
    sizes = [fwd.output_tensor_meta(i).nbytes() for i in range(min(fwd.num_outputs(), 3))]
    if not 1 <= len(sizes) <= 2 or max(sizes) > forward_bound(shape):
        raise _refuse(path, f"its forward method returns {fwd.num_outputs()} outputs of {sizes} bytes (one or "
                            f"two, each at most {forward_bound(shape)})")


def check_input_shape(shape: tuple[int, ...], info: Any, path: Path) -> None:
    """Once the metadata is read: `forward` is planned for exactly the batches and images it describes (what
    the exporter checks it wrote), so the bound checked before applies to what predict and serve feed it."""
    pre = info.preprocess
    want = (info.max_batch, pre.channels, pre.img_size, pre.img_size)
    if tuple(shape) != want:
        raise _refuse(path, f"its forward method is planned for inputs of {list(shape)}, its metadata says "
                            f"{list(want)}")


def forward_bound(shape: tuple[int, ...]) -> int:
    """Bytes `forward` may plan, or return, for a float32 input of `shape` (batch, channels, height, width)."""
    return min(4 * value_bound(shape[0], shape[1], max(shape[2:])), MAX_PLANNED_BYTES)


def _refuse(path: Path, what: str) -> UserError:
    return UserError(f"{path}: refusing this ExecuTorch program before the runtime loads it: {what}; re-export "
                     "it with `torchcls export --target executorch`")
