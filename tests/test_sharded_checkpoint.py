"""The sharded (torchrun) checkpoint format: safetensors shards + state.json, no pickle anywhere; an
exact resume from it; resharding by offsets; and the checks hf_dcp makes before DCP's reader sees a dir.
(The real torchrun runs, 2 -> 1 and 1 -> 2, FSDP2 and DDP: tests/test_distributed.py.)"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchcls.checkpoint import hf_dcp, sharded_state
from torchcls.checkpoint.checkpointer import Checkpointer, Progress
from torchcls.checkpoint.files import CheckpointMeta
from torchcls.checkpoint.safetensors_bounds import check_safetensors_header
from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError
from torchcls.models.registry import ModelSpec, create_model
from torchcls.training.ema import WeightEma

META = CheckpointMeta(ModelSpec("smallnet", 2, 3, 32), ["circle", "square"], Preprocess(32, 3, (0.5,) * 3, (0.5,) * 3),
                      {}, 1, 3)
PICKLE_HEADERS = {bytes([0x80, proto]) for proto in range(2, 6)}  # PROTO opcode: every pickle torch.load reads


@dataclass
class OneRank:
    """The Ranks of a torchrun world of one, without a process group (DCP saves in one process)."""
    active: bool = True
    rank: int = 0
    world: int = 1
    is_main: bool = True

    def barrier(self) -> None:
        pass


def _parts(seed: int):
    torch.manual_seed(seed)
    model = create_model(META.spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler, WeightEma(model, 0.5)


def _step(model, optimizer, scheduler, ema, step: int) -> float:
    torch.manual_seed(100 + step)
    loss = model(torch.randn(4, 3, 32, 32)).logsumexp(1).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    ema.update(model, step)
    return loss.item()


def test_a_sharded_checkpoint_holds_no_pickle_and_resumes_exactly(tmp_path: Path) -> None:
    model, optimizer, scheduler, ema = _parts(0)
    for step in range(3):
        _step(model, optimizer, scheduler, ema, step)
    ckpt = Checkpointer(tmp_path / "checkpoints", OneRank(), extras={"ema": ema})
    torch.manual_seed(7)  # the RNG a mid-epoch resume restores
    ckpt.save(model, optimizer, scheduler, Progress(1, 3, 1, 0.25, (1.5, 2.0, 4.0, 0.5)), META)
    rng = torch.get_rng_state()
    files = sorted(p.name for p in ckpt.last_dcp.iterdir())
    assert files == ["meta.json", "shard-00001-model-00001-of-00001.safetensors", "state.json"]
    for path in ckpt.directory.rglob("*"):  # nothing torch.load, pickle or numpy's allow_pickle would read
        if path.is_file():
            assert path.read_bytes()[:2] not in PICKLE_HEADERS, path
    check_safetensors_header(ckpt.last_dcp / files[1])
    saved = json.loads((ckpt.last_dcp / "state.json").read_text())
    assert saved["step"] == 3 and saved["epoch_sums"] == [[1.5, 2.0, 4.0, 0.5]]

    expected = [_step(model, optimizer, scheduler, ema, step) for step in range(3, 5)]
    fresh, fresh_opt, fresh_sched, fresh_ema = _parts(1)  # other weights: all of them must come from the files
    progress, restored_rng = Checkpointer(tmp_path / "checkpoints", OneRank(), extras={"ema": fresh_ema}).resume(
        fresh, fresh_opt, fresh_sched, META)
    assert progress == Progress(1, 3, 1, 0.25, (1.5, 2.0, 4.0, 0.5)) and torch.equal(restored_rng, rng)
    assert [_step(fresh, fresh_opt, fresh_sched, fresh_ema, step) for step in range(3, 5)] == expected  # bit for bit
    for a, b in zip((model, ema), (fresh, fresh_ema)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_state_json_and_the_tensors_are_split_and_put_back() -> None:
    tree = {"optim": {"state": {"w": {"step": 3, "exp_avg": torch.ones(2), "betas": (0.9, 0.99)}}}, "n": None}
    tensors, plain = sharded_state.split(tree)
    assert tensors == {"optim": {"state": {"w": {"exp_avg": tensors["optim"]["state"]["w"]["exp_avg"]}}}}
    assert plain == {"optim": {"state": {"w": {"step": 3, "betas": [0.9, 0.99]}}}, "n": None}
    restored = sharded_state.restore(plain, json.loads(json.dumps(plain)), "state.json")
    assert sharded_state.merge(tensors, restored)["optim"]["state"]["w"]["step"] == 3
    with pytest.raises(UserError, match="no saved value"):
        sharded_state.restore(plain, {"optim": {"state": {"w": {"step": 3}}}, "n": None}, "state.json")
    with pytest.raises(UserError, match="a str where this run has a int"):
        sharded_state.restore({"step": 1}, {"step": "1"}, "state.json")
    with pytest.raises(TypeError, match="object cannot be saved"):
        sharded_state.split({"x": object()})
    with pytest.raises(TypeError, match="tensor part"):  # what the safetensors writer would write as a pickle
        hf_dcp.check_tensors_only({"model": {"w": torch.ones(1)}, "step": 3})


def _shard(directory: Path, rank: int, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> Path:
    path = directory / f"shard-{rank:05d}-model-00001-of-00001.safetensors"
    info = json.dumps({k: {"saved_offsets": v} for k, v in offsets.items()})
    save_file(tensors, str(path), metadata={"DCP_SHARDING_INFO": info, "DCP_VERSION": "1.0", "format": "pt"})
    return path


def test_shards_are_put_together_by_their_offsets_and_must_cover_each_tensor(tmp_path: Path) -> None:
    whole = torch.arange(12.0).reshape(4, 3)
    _shard(tmp_path, 1, {"w": whole[:2].clone()}, {"w": [0, 0]})
    second = _shard(tmp_path, 2, {"w": whole[2:].clone()}, {"w": [2, 0]})
    target = {"w": torch.zeros(4, 3)}
    hf_dcp.load(target, tmp_path)  # two "ranks" of rows into one
    assert torch.equal(target["w"], whole)
    _shard(tmp_path, 2, {"w": whole[2:].clone()}, {"w": [1, 0]})  # overlaps the first: a gap at row 3
    with pytest.raises(UserError, match="not covered exactly"):
        hf_dcp.check_dir(tmp_path)
    _shard(tmp_path, 2, {"w": whole[:2].clone()}, {"w": [0, 0]})  # the same chunk twice
    with pytest.raises(UserError, match="contradicts another shard"):
        hf_dcp.check_dir(tmp_path)
    second.unlink()  # a rank's file missing: the rows it held are not in the checkpoint
    with pytest.raises(UserError, match="cannot load the sharded checkpoint"):
        hf_dcp.load({"w": torch.zeros(4, 3)}, tmp_path)


def test_a_shard_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    _shard(tmp_path, 1, {"w": torch.ones(2)}, {"w": [0]})
    fifo = tmp_path / "shard-00002-model-00001-of-00001.safetensors"
    os.mkfifo(fifo)  # DCP's reader would block opening it (safe_open waits for a writer)
    with pytest.raises(UserError, match="FIFO"):
        hf_dcp.check_dir(tmp_path)
    fifo.unlink()
    fifo.symlink_to(tmp_path / "shard-00001-model-00001-of-00001.safetensors")
    with pytest.raises(UserError, match="symbolic link"):
        hf_dcp.check_dir(tmp_path)


@pytest.mark.parametrize("edit,message", [
    (lambda h, n: (struct.pack("<Q", 2**63) + h[8:]), "claims 9223372036854775808 bytes"),
    (lambda h, n: h[:n - 4], "cut short"),
    (lambda h, n: h + b"\0", "the file has"),  # data past the last tensor
], ids=["header-length", "cut-short", "trailing-bytes"])
def test_a_damaged_shard_is_refused_naming_it(tmp_path: Path, edit, message: str) -> None:
    shard = _shard(tmp_path, 1, {"w": torch.ones(2)}, {"w": [0]})
    data = shard.read_bytes()
    shard.write_bytes(edit(data, len(data)))
    with pytest.raises(UserError, match=message) as refused:
        hf_dcp.check_dir(tmp_path)
    assert shard.name in str(refused.value)


@pytest.mark.parametrize("info,message", [
    (None, "no DCP_SHARDING_INFO"),
    ({"v": {"saved_offsets": [0]}}, "does not list exactly"),
    ({"w": {"saved_offsets": [0, 0]}}, "not 1 offsets"),
    ({"w": {"saved_offsets": [2**62]}}, "not 1 offsets"),
    ({"w": {"saved_offsets": [-1]}}, "not 1 offsets"),
    ({"w": {"saved_offsets": [0], "x": 1}}, "not 1 offsets"),
], ids=["missing", "other-names", "rank", "huge", "negative", "extra-key"])
def test_sharding_info_must_match_the_tensors(tmp_path: Path, info, message: str) -> None:
    metadata = {"DCP_VERSION": "1.0"} | ({"DCP_SHARDING_INFO": json.dumps(info)} if info is not None else {})
    save_file({"w": torch.ones(2)}, str(tmp_path / "shard-00001-model-00001-of-00001.safetensors"), metadata=metadata)
    with pytest.raises(UserError, match=message):
        hf_dcp.check_dir(tmp_path)


def test_overlapping_shards_that_add_up_to_the_whole_are_refused(tmp_path: Path) -> None:
    # chunks [0:2], [1:3], [4:5] of 5 elements: 5 elements in all, distinct offsets, and index 3 in none
    # (0bcf6c5 accepted them and the load left index 3 as it was)
    for rank, (offset, n) in enumerate([(0, 2), (1, 2), (4, 1)]):
        _shard(tmp_path, rank, {"w": torch.full((n,), float(rank))}, {"w": [offset]})
    with pytest.raises(UserError, match="overlaps another shard") as refused:
        hf_dcp.load({"w": torch.full((5,), -7.0)}, tmp_path)
    assert "'w'" in str(refused.value) and str(tmp_path) in str(refused.value)


def test_a_grid_of_shards_and_an_uneven_tiling_load(tmp_path: Path) -> None:
    whole = torch.arange(24.0).reshape(4, 6)
    layouts = {"grid": [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))],  # a 2 x 2 mesh
               "bricks": [((0, 0), (2, 4)), ((0, 4), (2, 2)), ((2, 0), (2, 1)), ((2, 1), (2, 5))]}
    for name, chunks in layouts.items():
        folder = tmp_path / name
        folder.mkdir()
        for rank, ((r, c), (h, w)) in enumerate(chunks):
            _shard(folder, rank, {"w": whole[r:r + h, c:c + w].clone()}, {"w": [r, c]})
        target = {"w": torch.zeros(4, 6)}
        hf_dcp.load(target, folder)
        assert torch.equal(target["w"], whole), name


def test_a_staircase_of_shards_is_refused_before_its_grid_is_counted() -> None:
    # n chunks whose edges cut the tensor into n**2 cells: the check's cost is bounded by the chunk count
    n = 400
    saved = hf_dcp.SavedTensor("F32", 2, {(i, i): (1, n - i) for i in range(n)})
    with pytest.raises(UserError, match="grid cells per shard"):
        hf_dcp.check_cover("w", saved, Path("ckpt"), hf_dcp.DEFAULT_BOUNDS)
