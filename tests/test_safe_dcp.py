"""Old-format (pickle) distributed checkpoints: refused unless --unsafe-unpickle, and even then read
without running code from them and within bounds (the bombs of issue 30, finding 3)."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchcls.checkpoint.safe_dcp import safe_load
from torchcls.errors import UserError


def _save(path: Path) -> dict:
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(24, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1, 5, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "progress": {"epoch": 3, "step": 17},
             "rng": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=str(path))  # no process group: one process writes it all
    return state


def test_a_real_checkpoint_loads_through_the_restricted_reader(tmp_path: Path) -> None:
    saved = _save(tmp_path / "ckpt")
    target = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()},
              "progress": {"epoch": 0, "step": 0}, "rng": torch.zeros_like(saved["rng"])}
    safe_load(target, tmp_path / "ckpt")
    for k, v in saved["model"].items():
        torch.testing.assert_close(target["model"][k], v)
    assert target["progress"] == {"epoch": 3, "step": 17}
    assert torch.equal(target["rng"], saved["rng"])


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    saved = _save(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    target = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
    with pytest.raises(UserError, match="refused to load its .metadata.*Nothing from it was run"):
        safe_load(target, tmp_path / "ckpt")
    assert not marker.exists()
    # torch's own reader would have run it: the reason this module exists.
    with pytest.raises(BaseException):  # noqa: PT011  (CheckpointException derives from BaseException)
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    assert marker.exists()


def _dotted_name_payload(marker: Path) -> bytes:
    """A protocol-4 pickle that reaches the function and code types through dotted names on an
    allowed DCP class (`Metadata.__init__.__class__`), builds a function that creates `marker`, calls it."""
    code = compile(f"open({str(marker)!r}, 'w').close()", "<payload>", "exec")
    fields = ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_nlocals", "co_stacksize", "co_flags",
              "co_code", "co_consts", "co_names", "co_varnames", "co_filename", "co_name", "co_qualname",
              "co_firstlineno", "co_linetable", "co_exceptiontable", "co_freevars", "co_cellvars")
    args = pickle.dumps(tuple(getattr(code, f) for f in fields), protocol=3)[2:-1]  # no PROTO or STOP, no frames

    def glob(name: str) -> bytes:
        return b"ctorch.distributed.checkpoint.metadata\n" + name.encode() + b"\n"

    return (b"\x80\x04" + glob("Metadata.__init__.__class__")  # the function type
            + glob("Metadata.__init__.__code__.__class__") + args + b"R"  # code object
            + b"}\x86R" + b")R.")  # FunctionType(code, {})()


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the payload builds a Python 3.11 code object")
def test_a_dotted_name_payload_is_refused_before_any_object_is_built(tmp_path: Path) -> None:
    saved = _save(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    payload = _dotted_name_payload(marker)
    pickle.loads(payload)  # the payload is real: a plain unpickler runs it
    assert marker.exists()
    marker.unlink()
    (tmp_path / "ckpt" / ".metadata").write_bytes(payload)
    target = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
    with pytest.raises(UserError, match=r"Metadata\.__init__\.__class__ is not a DCP metadata type"):
        safe_load(target, tmp_path / "ckpt")
    assert not marker.exists()


@pytest.mark.parametrize("module,name", [
    ("torch.distributed.checkpoint.metadata", "os"),  # a module reachable from an allowed one
    ("torch.distributed.checkpoint.metadata", "Metadata.__class__"),  # type itself, dotted
    ("torch.distributed.checkpoint.planner", "LoadPlan"),  # a DCP class, but not one .metadata holds
    ("builtins", "getattr"), ("torch", "load"), ("torch", "float32.__class__")])
def test_only_the_listed_globals_resolve(module: str, name: str) -> None:
    from torchcls.checkpoint.safe_dcp import _MetadataUnpickler

    payload = b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n."
    with pytest.raises(pickle.UnpicklingError, match="is not a DCP metadata type"):
        _MetadataUnpickler(__import__("io").BytesIO(payload)).load()


def test_consolidate_refuses_a_crafted_metadata_without_running_it(tmp_path: Path, trained_run: Path) -> None:
    """The CLI path the finding used: `torchcls consolidate` on a run dir whose last.dcp was replaced. Without
    --unsafe-unpickle the old format is refused unopened; with it, the restricted unpickler refuses the payload."""
    import subprocess

    from torchcls.checkpoint.files import load_model

    model, meta = load_model(trained_run / "checkpoints" / "best.safetensors")
    run = tmp_path / "run"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(run / "checkpoints" / "last.dcp"))
    (run / "checkpoints" / "last.dcp" / "meta.json").write_text(meta.to_json())
    marker = tmp_path / "pwned"
    (run / "checkpoints" / "last.dcp" / ".metadata").write_bytes(_dotted_name_payload(marker))
    for flags, said in (([], "reading it means unpickling"), (["--unsafe-unpickle"], "Nothing from it was run")):
        done = subprocess.run([sys.executable, "-m", "torchcls", "consolidate", *flags, str(run)], capture_output=True,
                              text=True)
        assert done.returncode == UserError.exit_code, done.stderr
        assert said in done.stderr and "Traceback" not in done.stderr
        assert not marker.exists()


def _str(s: str) -> bytes:
    return b"X" + len(s.encode()).to_bytes(4, "little") + s.encode()


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


@pytest.mark.parametrize("payload", [
    # a dict state on an allowed function: pickle's BUILD would replace _get_layout.cache process-wide
    _global("torch.serialization", "_get_layout") + b"}" + _str("cache") + b"}" + _str("torch.strided") + b"N" + b"ssb.",
    # (None, slots) state on an allowed class: pickle's BUILD would setattr on the class itself
    _global("torch.distributed.checkpoint.metadata", "Metadata") + b"N}" + _str("pwned") + _str("x") + b"s\x86b.",
    # a field that the dataclass does not have, on an instance
    _global("torch.distributed.checkpoint.metadata", "StorageMeta") + b")\x81}" + _str("__class__") + b"Nsb.",
], ids=["build-on-function", "build-on-class", "build-unknown-field"])
def test_build_only_fills_fields_of_dcp_instances(tmp_path: Path, payload: bytes) -> None:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.serialization import _get_layout

    _save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"\x80\x02" + payload)
    cache = _get_layout.cache
    before = dict(cache)
    try:
        with pytest.raises(UserError, match=r"ckpt: refused to load its \.metadata \(UnpicklingError: BUILD"):
            safe_load({}, tmp_path / "ckpt")
        assert _get_layout.cache is cache and _get_layout.cache == before
        assert "pwned" not in vars(Metadata)
    finally:  # on a reader without the check, leave the process as it was for the other tests
        _get_layout.cache = cache
        if "pwned" in vars(Metadata):
            delattr(Metadata, "pwned")


@pytest.mark.parametrize("payload,error", [
    (_global("torch.serialization", "_get_layout") + _str("x") + b"\x85R.", "KeyError"),
    (_global("torch", "Size") + _str("a") + b"\x85R.", "TypeError"),
    (_global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") + b"K\x09\x85R.", "ValueError"),
])
def test_any_error_of_an_allowed_type_is_a_user_error(tmp_path: Path, payload: bytes, error: str) -> None:
    _save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"\x80\x02" + payload)
    with pytest.raises(UserError, match=rf"ckpt: refused to load its \.metadata \({error}: .*Nothing from it was run"):
        safe_load({}, tmp_path / "ckpt")


def _entries(md) -> list:
    return [info for index, info in md.storage_data.items() if index.fqn == "model.3.weight"]


def _outside(tmp_path: Path) -> str:
    return str(tmp_path / "other" / "__0_0.distcp")


@pytest.mark.parametrize("change,message", [
    (lambda md, tmp: [setattr(i, "relative_path", _outside(tmp)) for i in _entries(md)], "not the name of a file"),
    (lambda md, tmp: [setattr(i, "relative_path", "../other/__0_0.distcp") for i in _entries(md)],
     "not the name of a file"),
    (lambda md, tmp: [setattr(i, "relative_path", "link.distcp") for i in _entries(md)], "not a regular file"),
    (lambda md, tmp: [setattr(i, "length", 10**12) for i in _entries(md)], "claims bytes"),
    (lambda md, tmp: [setattr(i, "offset", -5) for i in _entries(md)], "claims bytes"),
    (lambda md, tmp: [setattr(i, "transform_descriptors", ["zstd"]) for i in _entries(md)], "through transforms"),
    (lambda md, tmp: setattr(md.state_dict_metadata["model.3.weight"], "size", torch.Size([2, 10**9])),
     "not covered by its stored chunks"),
    (lambda md, tmp: [setattr(c, "sizes", torch.Size([2, 10**9])) or setattr(md.state_dict_metadata["model.3.weight"],
                                                                           "size", torch.Size([2, 10**9]))
                      for c in md.state_dict_metadata["model.3.weight"].chunks], "needs 8000000000 bytes"),
], ids=["absolute", "dotdot", "symlink", "length", "offset", "transform", "size", "chunk-size"])
def test_entries_must_lie_inside_the_checkpoints_own_files(tmp_path: Path, change, message: str) -> None:
    """A .metadata pointing a tensor at a file elsewhere (torch joins the dir and the name as written) or past
    a file's end is refused before anything is read: the target keeps its zeros, nothing else is taken in."""
    import io

    from torchcls.checkpoint.safe_dcp import _MetadataUnpickler

    saved = _save(tmp_path / "ckpt")
    other = {"model": {k: torch.full_like(v, 7.0) for k, v in saved["model"].items()}}
    dcp.save(other, checkpoint_id=str(tmp_path / "other"))  # what an attacker would want taken in
    (tmp_path / "ckpt" / "link.distcp").symlink_to(_outside(tmp_path))
    md = _MetadataUnpickler(io.BytesIO((tmp_path / "ckpt" / ".metadata").read_bytes())).load()
    change(md, tmp_path)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(md))
    target = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
    with pytest.raises(UserError, match=rf"ckpt/\.metadata: .*{message}"):
        safe_load(target, tmp_path / "ckpt")
    assert all(not v.any() for v in target["model"].values())
