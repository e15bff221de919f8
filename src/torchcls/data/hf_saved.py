"""A Hugging Face `save_to_disk` folder, read under bounds by torchcls itself, never by `datasets.load_from_disk`.

A saved folder describes itself in JSON: `state.json` names its Arrow files, `dataset_info.json` its
features, a DatasetDict's `dataset_dict.json` its split folders. `load_from_disk` parsed them unbounded and
opened whatever they named: an absolute path (`/etc/...`), `../..`, a file deeper down, a FIFO (where it
waited forever). Here each JSON file is a regular file parsed under stated bounds (`bounded_json`),
every name it gives is a plain name inside its own folder, and each Arrow file is checked to be a regular
file and memory-mapped by pyarrow through the checked descriptor (`io_files.regular_path`): nothing is
opened that the folder does not hold, and no name is reopened after its check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from typing_extensions import NotRequired, TypedDict

from torchcls.bounded_json import JsonBounds, read_bounded
from torchcls.data.label_bounds import MAX_CLASSES
from torchcls.errors import UserError
from torchcls.extras import missing_extra
from torchcls.io_files import regular_path
from torchcls.typed_json import check

MAX_ARROW_FILES = 10_000  # Arrow files of one split (save_to_disk writes one per 500 MB: 5 TB)
MAX_SPLITS = 64  # split folders of one DatasetDict
# state.json: a short list of file names and format options. dataset_info.json: the features, with a
# ClassLabel's names (up to MAX_CLASSES), a description and a citation. dataset_dict.json: the split names.
STATE_BOUNDS = JsonBounds(max_bytes=8 << 20, max_values=4 * MAX_ARROW_FILES + 10_000, max_depth=8, max_str=4_096)
INFO_BOUNDS = JsonBounds(max_bytes=64 << 20, max_values=4 * MAX_CLASSES + 100_000, max_depth=32, max_str=16 << 20)
SPLITS_BOUNDS = JsonBounds(max_bytes=1 << 20, max_values=4 * MAX_SPLITS, max_depth=4, max_str=256)
STATE, INFO, SPLITS = "state.json", "dataset_info.json", "dataset_dict.json"
NOT_HF = "so it is not a description as Hugging Face datasets writes it"  # typed_json.check's cause for these files


class Info(TypedDict):
    """dataset_info.json (and a Parquet file's 'huggingface' metadata `info`) as far as torchcls reads it: the
    features by column. Each column's entry is typed where it is used (hf.LabelFeature): an entry may be a list."""

    features: NotRequired[dict[str, Any] | None]  # None: datasets did not know them


@dataclass
class SavedSplit:
    table: Any  # pyarrow.Table, memory-mapped
    folder: Path  # the folder that holds its Arrow files, state.json and dataset_info.json
    files: list[Path]  # the Arrow files, in order


def _plain_name(value: Any, where: str, what: str) -> str:
    """`value` if it names an entry of its own folder: a non-empty string, no '/', not '.' or '..', no NUL."""
    if (not isinstance(value, str) or not value or value in (".", "..") or "\0" in value
            or PurePosixPath(value).name != value or "\\" in value):
        raise UserError(f"{where}: {what} {str(value)[:80]!r} is not a plain file name in its folder; a saved data "
                        "set names only files beside its description (refused: it could name any file)")
    return value


def split_names(folder: Path) -> list[str] | None:
    """The split folders a DatasetDict's dataset_dict.json lists, each a plain name; None when there is none."""
    listing = folder / SPLITS
    if not listing.exists():
        return None
    value = read_bounded(listing, SPLITS_BOUNDS, what=SPLITS)
    names = value.get("splits") if isinstance(value, dict) else None
    if not isinstance(names, list) or not names or len(names) > MAX_SPLITS:
        raise UserError(f"{listing}: 'splits' must list 1 to {MAX_SPLITS} split names")
    return [_plain_name(n, str(listing), "split") for n in names]


def features(folder: Path) -> dict:
    """dataset_info.json's feature descriptions (ClassLabel names live there), {} when there is no such file."""
    info = folder / INFO
    if not info.exists():
        return {}
    value = check(read_bounded(info, INFO_BOUNDS, what=INFO), Info, str(info), cause=NOT_HF)
    return value.get("features") or {}


def arrow_files(folder: Path) -> list[Path]:
    """The Arrow files state.json names, each a plain name of a file in `folder`."""
    state_path = folder / STATE
    if not state_path.exists():
        raise UserError(f"hf:{folder}: not a Hugging Face save_to_disk folder (no {STATE}, no {SPLITS})")
    state = read_bounded(state_path, STATE_BOUNDS, what=f"saved data set's {STATE}")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_ARROW_FILES:
        raise UserError(f"{state_path}: '_data_files' must list 1 to {MAX_ARROW_FILES:,} Arrow files")
    names = [_plain_name(e.get("filename") if isinstance(e, dict) else e, str(state_path), "file") for e in entries]
    if any(not n.endswith(".arrow") for n in names):
        raise UserError(f"{state_path}: it names a file that is not an .arrow file; refused")
    return [folder / n for n in names]


def read_split(folder: Path) -> SavedSplit:
    """The table of the saved Dataset in `folder`: every Arrow file state.json names, memory-mapped."""
    try:
        import pyarrow as pa
    except ModuleNotFoundError:
        raise missing_extra("hf", "--data hf:...", "pyarrow") from None
    files = arrow_files(folder)
    tables = [_read_arrow(pa, f) for f in files]
    try:
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    except pa.ArrowInvalid as e:
        raise UserError(f"{folder}: its Arrow files hold different columns ({e})") from None
    return SavedSplit(table, folder, files)


def _read_arrow(pa: Any, path: Path) -> Any:
    try:
        with regular_path(path, what="Arrow file of a saved data set") as checked:  # the mapping outlives the fd
            return pa.ipc.open_stream(pa.memory_map(checked)).read_all()
    except FileNotFoundError:
        raise UserError(f"{path}: named by {path.parent / STATE} but missing; re-save the data set") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path}: not an Arrow stream as save_to_disk writes them ({e})") from None
