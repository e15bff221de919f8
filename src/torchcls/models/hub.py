"""Pretrained weights from the Hugging Face hub, through huggingface_hub's cache.

Two forms of --pretrained are resolved here (checkpoint/pretrained.py handles local files and folders):
- `hf-hub:ORG/NAME[@REVISION]`: a repository in timm's layout: config.json names the architecture
  and its pretrained config (input size, mean/std, interpolation, crop ratio); the weights are
  model.safetensors, else pytorch_model.bin.
- `hub` (the bare flag `--pretrained`): the weights that --model's pretrained tag names in timm's
  registry (`convnext_tiny.fb_in22k_ft_in1k`; a name without a tag means timm's default tag).

The cache comes first: a file already there is used without asking the network (a run starts from
the same bytes it did before, and works offline); a missing one is downloaded, unless
HF_HUB_OFFLINE=1. Safetensors are preferred; a .bin is a pickle: checkpoint/pretrained.py refuses it
unless --unsafe-unpickle, and then timm reads it with torch.load(weights_only=True). The file found here
is what timm loads (through `file=`): timm never fetches from the hub itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typing_extensions import TypedDict

from torchcls.bounded_json import JsonBounds, read_bounded
from torchcls.data.label_bounds import MAX_CLASSES
from torchcls.errors import UserError
from torchcls.typed_json import check

HUB_PREFIX = "hf-hub:"
OWN_TAG = "hub"  # what the bare `--pretrained` flag stores: the weights --model's pretrained tag names
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # timm's order: safetensors first
# A hub config.json: timm's hold the pretrained config and, at most, the label names and descriptions of
# ImageNet-21k's 21,841 classes (~2 MB); the JSON is counted before it is parsed (bounded_json.py).
CONFIG_BOUNDS = JsonBounds(max_bytes=8 << 20, max_values=4 * MAX_CLASSES + 10_000, max_depth=8, max_str=4_096)


class ModelArgs(TypedDict, total=False):
    in_chans: int


class InputFields(TypedDict, total=False):
    input_size: list[int] | None  # [channels, height, width]: its length and ranges are from_timm's


class TimmConfig(InputFields, total=False):
    """What read_timm_config reads of a timm config.json (save_for_hf's form; before timm 0.9 one flat object,
    whose input fields are then its own)."""

    num_classes: int | None
    model_args: ModelArgs | None
    pretrained_cfg: InputFields


@dataclass(frozen=True)
class HubWeights:
    repo_id: str  # ORG/NAME
    revision: str  # the snapshot (commit) the files came from
    weights: Path  # the weights file inside the cache
    architecture: str  # the timm model the weights are for
    pretrained_cfg: dict[str, Any]  # timm's pretrained config: input size, mean/std, interpolation, crop_pct


def is_hub(value: str) -> bool:
    return value == OWN_TAG or value.startswith(HUB_PREFIX)


def cache_dir() -> Path:
    """Where huggingface_hub keeps downloads ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def fetch(value: str, model_name: str) -> HubWeights:
    """The config and weights `value` (an hf-hub: id, or `hub` with `model_name`'s tag) names, from the
    cache or downloaded into it."""
    if value == OWN_TAG:
        return _fetch_tagged(model_name)
    ref = value.removeprefix(HUB_PREFIX)
    repo_id, _, revision = ref.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"--pretrained {value}: give a hub repository as hf-hub:ORG/NAME[@REVISION], e.g. "
                        "hf-hub:timm/convnext_tiny.fb_in22k_ft_in1k (see `torchcls models --pretrained`)")
    config = _file(value, repo_id, "config.json", revision or None)
    if config is None:
        raise UserError(f"--pretrained {value}: the repository has no config.json, so it is not a timm model "
                        "(timm's repositories under hf-hub:timm/ are); download its weights and pass "
                        "--pretrained FILE with --model NAME")
    # Its model_args (num_classes, in_chans, ...) are not used: the data sets those, and one that shapes the
    # weights otherwise makes load_pretrained refuse, naming the tensors that do not fit.
    pretrained_cfg, architecture = read_timm_config(config.parent, value)
    weights = _weights(value, repo_id, revision or None, WEIGHT_FILES)
    return HubWeights(repo_id, weights.parent.name, weights, architecture, {**pretrained_cfg, "hf_hub_id": ref})


def read_timm_config(folder: Path, value: str) -> tuple[dict, str]:
    """(pretrained_cfg, architecture) of the timm-format config.json in `folder` (as timm's save_for_hf writes
    it: the architecture, num_classes and model_args beside its pretrained_cfg; before timm 0.9, one flat
    object), read under CONFIG_BOUNDS. timm's own reader of a local config is private and reads unbounded;
    timm.create_model("local-dir:...") would load weights nobody has checked yet. A config of another library
    (transformers' has "architectures") is refused."""
    path = folder / "config.json"
    cfg = read_bounded(path, CONFIG_BOUNDS, what="timm model config", follow_symlinks=True)  # a cache links to blobs
    cfg = cfg if isinstance(cfg, dict) else {}
    architecture, pretrained_cfg = cfg.get("architecture"), cfg.get("pretrained_cfg", cfg)
    if not (isinstance(architecture, str) and architecture and isinstance(pretrained_cfg, dict)):
        raise UserError(f"--pretrained {value}: {path} is not a timm model config (no \"architecture\" name beside "
                        "its pretrained config); timm's repositories are under hf-hub:timm/ (`torchcls models "
                        "--pretrained` lists them); for other weights pass --pretrained FILE with --model NAME")
    # The fields read here, typed before any is used (the input's ranges are PretrainedInput.from_timm's)
    check(cfg, TimmConfig, f"--pretrained {value}: {path}", cause="not what timm writes")
    model_args = cfg.get("model_args") or {}
    pretrained_cfg = {k: v for k, v in pretrained_cfg.items() if k != "architecture"}
    if "num_classes" in cfg:  # the weights' classifier, as timm reads it
        pretrained_cfg["num_classes"] = cfg["num_classes"]
    if model_args.get("in_chans") is not None:  # weights saved for other channels than RGB
        size = pretrained_cfg.get("input_size") or (3, 224, 224)
        pretrained_cfg["input_size"] = (model_args["in_chans"], *size[1:])
    return pretrained_cfg, architecture


def _fetch_tagged(model_name: str) -> HubWeights:
    from timm.models import get_pretrained_cfg, is_model

    name = model_name.removeprefix("ee/")
    if not is_model(name) or (cfg := get_pretrained_cfg(name)) is None:
        raise UserError(f"--pretrained without a value loads the weights --model's pretrained tag names on the "
                        f"Hugging Face hub, and '{model_name}' has none: give a timm name with a tag (`torchcls "
                        "models --pretrained` lists them, e.g. --model convnext_tiny.fb_in22k_ft_in1k), "
                        "--pretrained hf-hub:ORG/NAME, or --pretrained PATH")
    if not cfg.hf_hub_id:
        raise UserError(f"--pretrained: timm has no Hugging Face hub copy of {name}'s weights (only "
                        f"{cfg.url or 'none'}); download them and pass --pretrained FILE")
    repo_id, _, revision = cfg.hf_hub_id.partition("@")
    files = WEIGHT_FILES
    if cfg.hf_hub_filename:  # e.g. open_clip_pytorch_model.bin: its .safetensors twin first
        stem = cfg.hf_hub_filename.rsplit(".", 1)[0]
        files = (f"{stem}.safetensors", cfg.hf_hub_filename) if not cfg.hf_hub_filename.endswith(
            ".safetensors") else (cfg.hf_hub_filename,)
    label = f"{HUB_PREFIX}{cfg.hf_hub_id} (the pretrained tag of --model {model_name})"
    weights = _weights(label, repo_id, revision or None, files)
    architecture = name if "." in name else f"{name}.{cfg.tag}" if cfg.tag else name
    return HubWeights(repo_id, weights.parent.name, weights, architecture, cfg.to_dict())


def _weights(value: str, repo_id: str, revision: str | None, names: tuple[str, ...]) -> Path:
    # Cached files of any name first (no network at all), then downloads in preference order.
    for cached_only in (True, False):
        for name in names:
            path = _file(value, repo_id, name, revision, cached_only=cached_only)
            if path is not None:
                return path
    raise UserError(f"--pretrained {value}: the repository {repo_id} holds none of {', '.join(names)}; pass "
                    "--pretrained FILE with the weights")


def _file(value: str, repo_id: str, name: str, revision: str | None, cached_only: bool = False) -> Path | None:
    """`name` of the repository: from the cache, else downloaded; None when the repository has no such file."""
    from huggingface_hub import errors, hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, name, revision=revision)
    except errors.HFValidationError as e:  # e.g. timm/a..b: not a name the hub accepts
        raise UserError(f"--pretrained {value}: {str(e).splitlines()[0][:200]}") from None
    if isinstance(cached, str):
        return Path(cached)
    if cached is not None or cached_only:  # cached is the hub's earlier "no such file" answer
        return None
    if offline():
        raise _not_cached(value, repo_id, name, "HF_HUB_OFFLINE=1 is set")
    try:
        return Path(hf_hub_download(repo_id, name, revision=revision))
    except errors.LocalEntryNotFoundError:  # the network failed and the cache has nothing
        raise _not_cached(value, repo_id, name, "the hub is unreachable from here") from None
    except errors.EntryNotFoundError:
        return None
    except errors.RevisionNotFoundError:
        raise UserError(f"--pretrained {value}: {repo_id} has no revision {revision!r}") from None
    except errors.RepositoryNotFoundError:
        raise UserError(f"--pretrained {value}: no repository {repo_id} on the Hugging Face hub (or it is "
                        "private or gated: log in with `hf auth login`); `torchcls models --pretrained` lists "
                        "timm's") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise _not_cached(value, repo_id, name, str(e).splitlines()[0][:200]) from None


def _not_cached(value: str, repo_id: str, name: str, reason: str) -> UserError:
    folder = "models--" + repo_id.replace("/", "--")
    return UserError(f"--pretrained {value}: {name} is not in the Hugging Face cache {cache_dir()} and could not be "
                     f"downloaded ({reason}). Run once where huggingface.co is reachable (HF_HUB_OFFLINE unset) to "
                     f"fill the cache, or copy {folder}/ into {cache_dir()} (or set HF_HOME); with HF_HUB_OFFLINE=1 "
                     "the cache is used without the network")


def in_cache(hub_id: str) -> bool:
    """Whether the weights of `hub_id` (ORG/NAME[@REVISION]) are in the local cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    repo_id, _, revision = hub_id.partition("@")
    return any(isinstance(try_to_load_from_cache(repo_id, name, revision=revision or None), str)
               for name in WEIGHT_FILES)
