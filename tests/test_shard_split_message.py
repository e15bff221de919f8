"""`torchcls data shard --split`: what a split means for each layout, and a refusal whose advice works.

A plain class-folder tree has no val/ folder; the refusal once told the user to pass `--split val`,
the flag they had just passed. Its advice is now a command that runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_image_folder
from torchcls.cli import main


def shard(capsys, *argv: str) -> tuple[int, str]:
    code = main(["data", "shard", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("source", ["tree", "mnist-5k"])
def test_a_source_without_a_val_split_is_refused_with_advice_that_runs(tmp_path: Path, capsys, source: str):
    if source == "tree":
        source = str(make_image_folder(tmp_path / "tree", per_class=3, size=16))
    code, message = shard(capsys, source, "--split", "val", "--out", str(tmp_path / "val"))
    assert code == 2 and "--split val" not in message and "--split train" in message
    assert not (tmp_path / "val").exists()
    if source != "mnist-5k":  # the advice, followed, writes the shards
        code, message = shard(capsys, source, "--split", "train", "--out", str(tmp_path / "all"))
        assert code == 0 and "wrote 6 samples" in message


def test_a_split_layout_gives_each_split_its_own_shards(tmp_path: Path, capsys):
    for split, n in (("train", 3), ("val", 2)):
        make_image_folder(tmp_path / "ds" / split, per_class=n, size=16)
    for split, n in (("train", 6), ("val", 4)):
        code, message = shard(capsys, str(tmp_path / "ds"), "--split", split, "--out", str(tmp_path / split))
        assert code == 0, message
        assert json.loads((tmp_path / split / "index.json").read_text())["num_samples"] == n
