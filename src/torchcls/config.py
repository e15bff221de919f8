"""Typed configuration: the single source of truth for every training option.

Each field carries its help text (and choices) in `metadata`; the CLI builds its
flags from these dataclasses, so an option is declared exactly once. A config is
loaded from TOML (sections named like the dataclass fields of `Config`; options that
moved out of [train] are still read there, see MOVED), then overridden by CLI flags,
and the resolved result is written into the run dir.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import tomli_w

from torchcls.errors import UserError
from torchcls.run_files import write_text_atomic
from torchcls.toml_files import read_toml  # bounded before parsed: a run dir's config.toml is input


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None, flag: str | None = None,
        const: Any = None, bound: Range | None = None) -> Any:
    """A config field with its CLI help (and optional choices / flag name). `const`: the value of the flag
    given without one (`--pretrained` alone). `bound`: the range of a number option of a command (as INT_RANGES
    or FLOAT_RANGES declare it: an IntRange or a FloatRange; the training config's own options are in those
    tables)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "const": const,
                                            "bound": bound})


@dataclass
class DataConfig:
    source: str = opt("mnist-5k", "built-in data set (mnist-5k, fashion-mnist), an ImageFolder directory (one "
                      "folder per class, or train/ val/ test/ folders), a CSV manifest with columns "
                      "path,label[,split], WebDataset shards (a folder from `torchcls data shard`, or a brace "
                      "pattern such as 'shards/train-{000000..000009}.tar'), or hf:PATH (a local Hugging Face "
                      "dataset)", flag="data")
    root: str | None = opt(None, "directory of the fashion-mnist IDX files (default: the Debian package's "
                           "/usr/share/datasets/fashion-mnist); for a CSV, the base of relative paths "
                           "(default: the CSV's folder)")
    val_fraction: float = opt(0.2, "fraction of the training data held out for validation (seeded split)")
    img_size: int | None = opt(None, "input size in pixels (default: 28 for built-in sets, 224 for image files)")
    resize_schedule: str = opt("", "progressive resizing: the first epochs train on smaller images, "
                               "'SIZE:EPOCHS,...' (e.g. '16:4,20:2' = 4 epochs at 16 px, 2 at 20 px, the rest at "
                               "--img-size); each training batch is resized on the device after augmentation; "
                               "validation, checkpoints and inference use --img-size. For models that accept other "
                               "input sizes (convolution nets with global pooling); empty = off")
    channels: int | None = opt(None, "input channels, 1 or 3 (default: 1 for built-in sets, 3 for image files); "
                               "images are converted to match")
    augment: str = opt("light", "training augmentation: none; light = small shifts (digits, text); flip = shifts "
                       "and horizontal flips; standard = random resized crops and flips (photos); randaugment, "
                       "trivialaugment, autoaugment = torchvision's policies (ImageNet op set); flip-alternate = "
                       "flip's shifts, and each image mirrored in every other epoch: in epoch 0 a seeded half of the "
                       "images, in odd epochs exactly the others (airbench's alternating flip; in-memory loader only)",
                       choices=("none", "light", "flip", "flip-alternate", "standard", "randaugment", "trivialaugment",
                                "autoaugment"))
    max_shift: int | None = opt(None, "light/flip: the largest random shift in pixels (RandomCrop's padding); "
                                "default: an eighth of --img-size (3 px at 28); 0 = no shifts (flip: mirrors only)")
    random_erasing: float = opt(0.0, "probability of erasing a random box of each training image (after "
                                "normalisation, so the box takes the mean colour); 0 = off")
    mixup: float = opt(0.0, "mixup alpha: blend pairs of training images and their labels with a Beta(A, A) "
                       "weight (soft-target loss; needs an even batch); 0 = off")
    cutmix: float = opt(0.0, "cutmix alpha: paste a box of one training image into another, labels weighted by "
                        "area (with --mixup, one of the two per batch); 0 = off")
    batch_size: int = opt(128, "images per training step")
    workers: int = opt(2, "DataLoader worker processes (0 = load in the main process)")
    on_bad_file: str = opt("error", "what to do with unreadable images: stop with an error, or skip them "
                           "(counted and listed in the report)", choices=("error", "skip"))
    val_data: str | None = opt(None, "a separate validation set: an ImageFolder directory (its val/ folder if it has "
                               "train/ val/ test/ folders) or a CSV manifest; replaces --val-fraction. Default: the "
                               "source's own val/ folder or split=val rows, else --val-fraction")
    image_column: str = opt("image", "--data hf:PATH: the column holding the images (datasets Image feature, "
                            "encoded bytes or file paths)")
    label_column: str = opt("label", "--data hf:PATH: the column holding the labels (ClassLabel, integer or string)")
    max_pixels: int = opt(64_000_000, "largest image, in pixels, decoded at full size (a guard against "
                          "decompression bombs; JPEGs far larger than the input decode reduced); 0 = no limit")
    in_memory: str = opt("auto", "decode the data once into a uint8 cache at the input size and build batches from "
                         "it with whole-batch augmentation, no worker processes: auto = when the cache fits in "
                         "--memory-limit-mb; on = always (refused if it does not fit); off = the per-sample loader",
                         choices=("auto", "on", "off"))
    memory_limit_mb: int = opt(4096, "largest in-memory cache (MB, per process) that --in-memory auto/on builds")
    decode: str = opt("auto", "where the per-sample loader decodes JPEGs: workers = in the DataLoader worker "
                      "processes (CPU); device = torchvision.io.decode_jpeg on the training device, one call per "
                      "batch (nvJPEG on CUDA), crops, flips and normalisation there too (presets none, light, flip, "
                      "standard); auto = device when training on CUDA from JPEG files", choices=("auto", "workers",
                                                                                                 "device"))
    task: str = opt("multiclass", "multiclass: one label per image (cross-entropy); multilabel: any number of labels "
                    "per image, from a CSV `labels` column separated by ';' (one sigmoid per class, BCE loss)",
                    choices=("multiclass", "multilabel"))
    balanced_sampler: bool = opt(False, "draw training images with probability inversely proportional to their "
                                 "class frequency (each epoch still has as many images as the training set)")


@dataclass
class ModelConfig:
    name: str = opt("smallnet", "model: 'smallnet' (built-in, for 28x28), any timm name, or a torchvision "
                    "classification name prefixed 'tv/' (e.g. tv/resnet18); `torchcls models` lists them; random "
                    "init unless --pretrained",
                    flag="model")
    drop_rate: float = opt(0.0, "dropout before the classifier")
    drop_path: float = opt(0.0, "stochastic depth: the rate at which residual branches of timm models are dropped "
                           "in training (timm's drop_path_rate), in [0, 1); 0 = off")
    exits: int = opt(0, "early-exit models (ee/smallnet, ee/resnet18, ...): intermediate exits after the first "
                     "stages (0 = after every stage but the last)")
    exit_threshold: float = opt(0.9, "early-exit models: a sample leaves at the first exit whose max softmax "
                                "probability reaches this value, in [0, 1]")
    freeze: str = opt("", "train only part of the model: backbone = everything but the classifier; stages:N = "
                      "the stem and the first N stages; empty = nothing frozen")
    pretrained: str | None = opt(None, "start from pretrained weights: hf-hub:ORG/NAME (a timm model on the Hugging "
                                 "Face hub, from its cache or downloaded; --model and the preprocessing follow its "
                                 "config unless given), the flag alone (= 'hub': the weights --model's pretrained "
                                 "tag names, e.g. --model convnext_tiny.fb_in22k_ft_in1k), a torchcls run dir or "
                                 "checkpoint, a timm or torchvision state dict (.safetensors, or .pth/.bin read with "
                                 "weights_only), or a local hub folder; the classifier is re-initialised when the "
                                 "classes differ and the first convolution adapted when the channels differ",
                                 const="hub")
    init: str = opt("", "initialisation on top of the model's own (random init only), comma-separated: whiten = the "
                    "first convolution's filters from the training images' patch covariance (its eigenvectors over "
                    "sqrt(eigenvalue + --whiten-eps), each also negated: 2 x channels x k x k filters; with fewer "
                    "out-channels the top eigenvectors, with more the rest keep their init); dirac = every later "
                    "stride-1 convolution starts as the identity on its first min(in, out) channels; empty = off")
    whiten_eps: float = opt(5e-4, "--init whiten: added to each eigenvalue before its square root (bounds the gain "
                            "of the flattest directions)")
    freeze_first_conv: bool = opt(False, "do not train the weight of the model's first convolution (e.g. its "
                                  "--init whiten filters, as airbench keeps them); its bias still trains")


@dataclass
class OptimConfig:
    optimizer: str = opt("adamw", "optimizer (timm's optimizer factory; parameters a model names in "
                         "no_weight_decay(), norms and biases are not decayed)",
                         choices=("adamw", "sgd", "adam", "lamb", "lion", "lars", "rmsprop", "adopt"))
    lr: float = opt(3e-3, "peak learning rate (reached after warm-up, then follows --sched)")
    sched: str = opt("cosine", "learning-rate schedule after the warm-up: cosine to 0; linear = straight down to 0 "
                     "(airbench's); step = x0.1 at 1/3 and 2/3 of the epochs; onecycle = one cycle (warm-up, then "
                     "cosine annealing to 0, SGD momentum cycled); plateau = x0.1 when the validation loss stops "
                     "improving", choices=("cosine", "linear", "step", "onecycle", "plateau"))
    layer_decay: float = opt(0.0, "layer-wise learning-rate decay: each block further from the head gets F times "
                             "its successor's rate (timm's layer_decay; e.g. 0.75 for fine-tuning a ViT); 0 = off")
    head_lr: float = opt(1.0, "learning rate of the classifier head as a multiple of --lr (e.g. 10 when "
                         "fine-tuning a pretrained backbone)")
    accum_steps: int = opt(1, "accumulate gradients over N micro-batches of --batch-size before each optimizer "
                           "step (an effective batch of N x --batch-size; no gradient sync on the inner steps "
                           "under ddp/fsdp2)")
    ema: float = opt(0.0, "keep an exponential moving average of the weights with this decay (e.g. 0.999); it is "
                     "validated every epoch beside the raw weights and the better one becomes best.safetensors; "
                     "0 = off")
    class_weights: str = opt("none", "weight the loss of each class: auto = inversely to its frequency in the "
                             "training set; none = equal", choices=("none", "auto"))
    weight_decay: float = opt(0.05, "decoupled weight decay (not applied to norms and biases)")
    momentum: float = opt(0.9, "SGD momentum (Nesterov)")
    warmup_epochs: float = opt(0.5, "linear warm-up length in epochs")
    label_smoothing: float = opt(0.1, "label smoothing of the cross-entropy loss")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0 = off)")
    bn_bias_lr_scale: float = opt(1.0, "learning rate of BatchNorm biases as a multiple of the others' (airbench: "
                                  "64); they stay out of weight decay; 1 = the same rate")
    freeze_first_bias_after_epochs: int = opt(0, "stop training the first layer's bias after N epochs: the first "
                                              "convolution's bias, or when it has none the bias of the BatchNorm "
                                              "right after it; 0 = never")
    lookahead: int = opt(0, "wrap the optimizer in Lookahead (timm.optim.Lookahead): every K steps the slow "
                         "weights move --lookahead-alpha of the way to the fast ones and the fast ones restart from "
                         "them (also at each epoch end, so validation and checkpoints see them); 0 = off")
    lookahead_alpha: float = opt(0.5, "--lookahead: the slow weights' step towards the fast ones, in (0, 1]")
    selective_backprop: float = opt(0.0, "train on this fraction of each batch, in (0, 1): its images with the "
                                    "highest loss under a forward without gradients (Selective-Backprop); 0 = all")
    selective_backprop_after_epochs: int = opt(0, "--selective-backprop: applies from this epoch on (0-based: "
                                               "after N full epochs)")


@dataclass
class TrainConfig:
    """The run itself: length, seed, device, compile, logging."""

    epochs: int = opt(5, "training epochs")
    seed: int = opt(0, "seed for init, data split, data order and augmentation")
    channels_last: bool | None = opt(None, "channels_last memory format for the model and its batches "
                                     "(--no-channels-last: contiguous NCHW). Unset: on a CPU, each layout (and, "
                                     "with --precision auto, bf16 vs fp32) is timed for a few steps and the faster "
                                     "one trains; on a GPU, channels_last for convolution nets")
    compile: bool = opt(False, "torch.compile the model for training (reports graph breaks)")
    device: str = opt("auto", "device: auto, cpu, cuda, cuda:N")
    threads: int = opt(0, "intra-op CPU threads (0 = OMP_NUM_THREADS if set, else the CPUs this process may use "
                       "(affinity, cgroup quota) less up to half of them for DataLoader workers; recorded in "
                       "machine.json)")
    tensorboard: bool = opt(False, "also log scalars to TensorBoard (needs the 'tensorboard' package)")
    log_every: int = opt(0, "write a step record (loss averaged over ranks, learning rate) every N optimizer "
                         "steps (0 = ten times an epoch)")
    progress: bool = opt(True, "show a progress bar")
    early_stop: int = opt(0, "stop when the validation top-1 (multilabel: mAP) has not improved for N epochs "
                          "(0 = train all --epochs)")
    tracking: str = opt("none", "also log the run (params, metrics per step and epoch, report, final checkpoint) "
                        "to an experiment tracker", choices=("none", "mlflow"))
    tracking_uri: str | None = opt(None, "--tracking mlflow: the tracking store: a server URL, sqlite:///FILE or a "
                                   "folder (it holds mlflow.db and mlruns/; default: $MLFLOW_TRACKING_URI, else the "
                                   "current folder: ./mlflow.db and ./mlruns/, MLflow's own default)")
    tracking_experiment: str = opt("torchcls", "--tracking mlflow: the experiment the run is logged under")
    memory_report: bool = opt(False, "write allocator.json: on CUDA the caching allocator's stats per step (allocated "
                              "vs reserved, fragmentation, alloc retries, OOMs) with advice; on CPU the profiler's "
                              "memory events over steps 3-5 and peak RSS")
    memory_snapshot: bool = opt(False, "also write memory_snapshot.pickle for https://pytorch.org/memory_viz "
                                "(CUDA only; implies --memory-report)")


@dataclass
class PrecisionConfig:
    """Training precision (autocast, FP8) and what to do with a non-finite step."""

    precision: str = opt("auto", "training precision: auto = bf16 where the hardware computes it natively (a CPU "
                         "with AVX-512-bf16 or AMX, a GPU of compute capability >= 8.0), else fp32 (the run says "
                         "which and why); fp32; bf16 autocast (CPU and GPU; emulated, so much slower, on CPUs without "
                         "native bf16); fp16 autocast with a gradient scaler (CUDA); fp8 linears via "
                         "torchao/TransformerEngine (GPU with compute capability >= 8.9, or --fp8-emulate); master "
                         "weights stay fp32", choices=("auto", "fp32", "bf16", "fp16", "fp8"))
    fp8_recipe: str = opt("tensorwise", "FP8 scaling recipe: one scale per tensor (fastest) or per row (more "
                          "accurate)", choices=("tensorwise", "rowwise"))
    fp8_backend: str = opt("torchao", "FP8 implementation: torchao float8, or NVIDIA TransformerEngine (te; "
                           "optional, not installed by torchcls)", choices=("torchao", "te"))
    fp8_emulate: bool = opt(False, "run FP8 through torchao's emulation (CPU or any GPU): checks numerics, no "
                            "speed-up")
    fp8_min_dim: int = opt(0, "convert a Linear to FP8 only when max(in, out) >= this (0 = the shape rule: "
                           "from each layer's tokens per step, in and out features, a measured --fp8-table or "
                           "torchao's roofline; see docs/precision.md); dims must also divide by 16")
    fp8_table: str | None = opt(None, "JSON of measured FP8/bf16 speed-ups per GEMM shape, written by "
                                "benchmarks/gpu/fp8_gemm.py on this GPU: the shape rule uses it where it covers "
                                "a layer's shape (default: torchao's roofline model only)")
    fp8_compile: bool = opt(True, "torch.compile the model when training in (non-emulated) torchao FP8, as "
                            "torchao recommends")
    fp8_fsdp_all_gather: bool = opt(False, "with --parallel fsdp2: all-gather the weights already cast to FP8 "
                                    "(half the bytes of bf16; one all-reduce per step computes every scale); "
                                    "torchao tensorwise recipe only")
    nonfinite: str = opt("stop", "on a NaN/Inf loss or gradient norm: stop with a checkpoint and a message, or "
                         "skip the step (logged; stops after 10 in a row)", choices=("stop", "skip"))
    nonfinite_check: str = opt("auto", "when the NaN/Inf check reads the device: every step (a host synchronisation "
                               "per step); deferred = the decision stays on the device (the fused optimizer skips "
                               "a non-finite update itself) and is read at log steps and epoch ends; auto = "
                               "deferred on CUDA, every step on the CPU (where reading costs nothing)",
                               choices=("auto", "every-step", "deferred"))


@dataclass
class ParallelConfig:
    """Processes started by torchrun: DDP or FSDP2, and the process group."""

    parallel: str = opt("none", "parallelism across processes started by torchrun: none (one process), ddp "
                        "(replicated weights), fsdp2 (sharded parameters, gradients and optimizer state)",
                        choices=("none", "ddp", "fsdp2"))
    sync_bn: bool = opt(False, "ddp/fsdp2: SyncBatchNorm (batch statistics over the global batch; needs CUDA). "
                        "Without it BatchNorm running stats are averaged across ranks before eval and save")
    fsdp_param_dtype: str = opt("fp32", "fsdp2: dtype parameters are all-gathered and computed in",
                                choices=("fp32", "bf16"))
    fsdp_reduce_dtype: str = opt("fp32", "fsdp2: dtype gradients are reduce-scattered in", choices=("fp32", "bf16"))
    reshard_after_forward: bool = opt(True, "fsdp2: free gathered parameters after forward (less memory, one "
                                      "more all-gather in backward)")
    fsdp_cpu_offload: bool = opt(False, "fsdp2: keep sharded parameters, gradients and optimizer state in host "
                                 "memory (CUDA training only)")
    fsdp_init_from_rank0: bool = opt(True, "fsdp2: only rank 0 builds the whole model (on the CPU); every rank "
                                     "builds it on the meta device, shards it and receives its shards' weights "
                                     "from rank 0")
    dist_timeout: int = opt(300, "ddp/fsdp2: seconds before joining the process group or a collective gives up "
                            "with an error instead of hanging")


@dataclass
class CheckpointConfig:
    """When and how checkpoints are written."""

    save_every: int = opt(0, "also checkpoint every N steps (0 = at epoch ends only)")
    async_checkpoint: bool = opt(False, "ddp/fsdp2: write sharded (DCP) checkpoints in a background thread")
    unsafe_unpickle: bool = opt(False, "read files that only a pickle reader can read: an older run's training state "
                                "(last.state.pt) and --pretrained .pth/.pt/.bin weights, through torch's restricted "
                                "unpickler (weights_only=True). Only for files you trust; command line or API only, "
                                "a config file cannot set it")


@dataclass
class RunConfig:
    name: str | None = opt(None, "run name: the run dir is OUT_DIR/NAME (default: <model>-<data>-<time>)")
    out_dir: str = opt("runs", "parent directory of run dirs")
    resume: bool = opt(False, "continue the run in OUT_DIR/NAME from its last checkpoint")


@dataclass
class GovernanceConfig:
    policy: str | None = opt(None, "data-governance policy TOML: training refuses to start, before any data is "
                             "read, when the data, host region or installed hooks break it")
    data_manifest: str | None = opt(None, "manifest of the data (from `torchcls data manifest`); its files are "
                                    "re-hashed before training (default: computed at the start of the run)")
    region: str | None = opt(None, "region of this processing host as configured (e.g. eu-west-1), "
                             "checked against the policy and recorded in the audit log")
    hooks: str = opt("", "comma-separated names of processing hooks: the built-in strip-exif and redact-samples, "
                     "a hook an installed package publishes (entry point group torchcls.hooks), or one your own "
                     "Python registered with @torchcls.governance.hook before torchcls.train; a name, never a "
                     "module path (see torchcls.governance.hooks)")
    sample_grid: int = opt(0, "show N training samples in report.html and TensorBoard (restricted samples "
                           "are redacted or withheld per policy)")
    lineage: bool = opt(True, "append this run to the hash-chained audit log and stamp its checkpoints "
                        "with the lineage id")
    audit_log: str | None = opt(None, "audit log file (default: OUT_DIR/_governance/audit.jsonl)")
    audit_key_file: str | None = opt(None, "file holding the legacy audit key that signs each audit record (HMAC: "
                                     "proves nothing to anyone else, who would need the same secret); keep it "
                                     "outside the run and log directories (default: the TORCHCLS_AUDIT_KEY "
                                     "environment variable; unset = unsigned)")
    signing_key_file: str | None = opt(None, "private key (PEM, from `torchcls governance keygen`) that signs each "
                                       "audit record and export; verifying needs only its public key. Keep it outside "
                                       "the run and log directories, mode 0600 (default: the TORCHCLS_SIGNING_KEY "
                                       "environment variable; used instead of the audit key when both are set)")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    governance: GovernanceConfig = field(default_factory=GovernanceConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every option but the TRUST_OPTIONS: what config.toml and a checkpoint's metadata record."""
        raw = dataclasses.asdict(self)
        for section, key in TRUST_OPTIONS:
            del raw[section][key]
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any], origin: str = "config", base: Config | None = None) -> Config:
        cfg = base if base is not None else cls()  # base: a recipe the file's options override
        for section, values in raw.items():
            if section not in SECTIONS:
                raise UserError(f"{origin}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise UserError(f"{origin}: [{section}] must be a table of options")
            for key, value in values.items():
                if (moved_section(section, key), key) in TRUST_OPTIONS:
                    raise UserError(f"{origin}: [{section}] {key} cannot be set by a file (it would let the file "
                                    f"decide what is trusted); give --{key.replace('_', '-')} on the command line")
                set_option(cfg, moved_section(section, key), key, value, origin)
        return cfg

    @classmethod
    def recorded(cls, raw: dict[str, Any], origin: str) -> Config:
        """The config a checkpoint recorded, for a later command (evaluate, export's parity and calibration
        images): its options as written, except the RECORDED_NOT_TAKEN ones (BOUND_OPTIONS...), which keep this
        machine's defaults. A checkpoint from elsewhere describes how its model was trained; it does not
        raise what reading input may cost here, nor say where data is sent. A value outside the range this version
        declares is not taken either (`in_range_only`): a checkpoint written before the range was still loads."""
        cfg = cls.from_dict(in_range_only(raw, origin), origin)
        keep_local(cfg, cls())
        return cfg

    def save_toml(self, path: Path) -> None:
        # TOML has no null: unset optional values are simply omitted.
        clean = {s: {k: v for k, v in vals.items() if v is not None} for s, vals in self.to_dict().items()}
        write_text_atomic(path, tomli_w.dumps(clean))  # a run dir's: the name replaced, never written through


SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig,
                             "precision": PrecisionConfig, "parallel": ParallelConfig, "checkpoint": CheckpointConfig,
                             "run": RunConfig, "governance": GovernanceConfig}

# Options that grant trust (reading a pickle): only the command line or the API sets them. A file (a
# --config TOML, a received run dir's config.toml, a checkpoint's recorded config) never does: from_dict
# refuses them and to_dict leaves them out, so nothing torchcls writes carries them either.
TRUST_OPTIONS = frozenset({("checkpoint", "unsafe_unpickle")})

# Options that bound what reading input may cost (pixels decoded, memory cached). A user's own --config
# sets them; a recorded config does not: a checkpoint's, read back by evaluate or export (Config.recorded),
# or a run dir's config.toml given as --config (`train --config runs/x/config.toml --resume`: keep_local).
BOUND_OPTIONS = frozenset({("data", "max_pixels"), ("data", "memory_limit_mb")})

# Options that send the run's data elsewhere: --tracking mlflow uploads params, metrics, the report and the
# final checkpoint to --tracking-uri. Recorded configs never set them either (a received run dir's
# config.toml naming tracking_uri = "http://attacker" would have it upload there); the command line does.
EGRESS_OPTIONS = frozenset({("train", "tracking"), ("train", "tracking_uri")})

# Options that name files of this machine a run appends to or signs with: the audit log and its keys. Not
# from a recorded config either (a received run dir's config.toml would choose where a resumed run appends its
# record, and which key file of the user's signs it); the command line, or the defaults beside the runs.
LOCAL_FILE_OPTIONS = frozenset({("governance", "audit_log"), ("governance", "audit_key_file"),
                                ("governance", "signing_key_file")})
RECORDED_NOT_TAKEN = BOUND_OPTIONS | EGRESS_OPTIONS | LOCAL_FILE_OPTIONS

# What a folder holds when it is a run dir (training/rundir.py writes them): a config.toml beside them is
# a recorded config, whatever run it names.
RUN_DIR_FILES = ("metrics.jsonl", "checkpoints", ".created-by.json")

# Options that once lived in [train] and moved to their own section. Config files written before
# the split, and the config stored inside older checkpoints, still load: the key is read into
# its new section (writing uses the new sections only).
MOVED: dict[tuple[str, str], str] = {
    ("train", f.name): section
    for section, cls in (("precision", PrecisionConfig), ("parallel", ParallelConfig), ("checkpoint", CheckpointConfig))
    for f in dataclasses.fields(cls)
}


def moved_section(section: str, key: str) -> str:
    """The section an option lives in now (`section` unless the option moved out of it)."""
    return MOVED.get((section, key), section)


def load_toml(path: str | Path, base: Config | None = None) -> Config:
    path = Path(path)
    if not path.exists():  # (a FIFO or device exists: read_toml refuses it, saying what it is)
        raise UserError(f"config file {path} does not exist")
    return Config.from_dict(read_toml(path, "config file"), origin=str(path), base=base)


def is_recorded_config(path: str | Path, cfg: Config) -> bool:
    """Whether the --config file `path` is a run dir's recorded config.toml: that of the run dir `cfg` trains in
    (OUT_DIR/NAME, resolved), or any config.toml beside a run dir's files (a received one may name another run)."""
    path = Path(path).resolve()
    if cfg.run.name and path == (Path(cfg.run.out_dir) / cfg.run.name / "config.toml").resolve():
        return True
    return path.name == "config.toml" and any(os.path.lexists(path.parent / name) for name in RUN_DIR_FILES)


def resume_command(run_path: Path, cfg: Config) -> str:
    """The command that resumes `run_path` as `cfg` ran it: its config.toml, and on the command line the
    RECORDED_NOT_TAKEN options it set (a recorded config.toml does not set them)."""
    default, flags = Config(), []
    for section, key in sorted(RECORDED_NOT_TAKEN):
        value = getattr(getattr(cfg, section), key)
        if value != getattr(getattr(default, section), key):
            flags.append(f"--{key.replace('_', '-')} {value}")
    return " ".join([f"torchcls train --config {run_path / 'config.toml'} --resume", *flags])


def keep_local(cfg: Config, local: Config, given: frozenset[tuple[str, str]] = frozenset()
               ) -> list[tuple[str, str, Any]]:
    """Put the RECORDED_NOT_TAKEN options of `cfg` that are not in `given` (set on the command line) back to
    `local`'s values (the defaults, or the recipe's); returns (section, key, recorded value) of each changed."""
    ignored = []
    for section, key in sorted(RECORDED_NOT_TAKEN - given):
        recorded, mine = getattr(getattr(cfg, section), key), getattr(getattr(local, section), key)
        if recorded != mine:
            ignored.append((section, key, recorded))
            setattr(getattr(cfg, section), key, mine)
    return ignored


def field_type(f: dataclasses.Field) -> type:
    """The concrete type of a field, with `X | None` reduced to X."""
    t = typing.get_type_hints(_owner_of(f))[f.name]
    if takes_none(f):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def takes_none(f: dataclasses.Field) -> bool:
    """Whether the field is typed `X | None`, None meaning "not set" (`img_size`: the data's own size)."""
    t = typing.get_type_hints(_owner_of(f))[f.name]
    return (isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union) and type(None) in typing.get_args(t)


def _owner_of(f: dataclasses.Field) -> type:
    for cls in SECTIONS.values():
        if any(g is f for g in dataclasses.fields(cls)):
            return cls
    raise KeyError(f.name)


class IntRange(NamedTuple):
    """The integers from `lo` to `hi`, both allowed; `why` says what the bound keeps within a machine."""
    lo: int
    hi: int
    why: str

    def problem(self, value: Any) -> str | None:
        """'VALUE is outside the allowed range LO to HI (why)' for an int outside, else None (a value of another
        type is left to the type check)."""
        if type(value) is int and not self.lo <= value <= self.hi:
            return f"{_shown(value)} is outside the allowed range {self.lo:,} to {self.hi:,} ({self.why})"
        return None


class FloatRange(NamedTuple):
    """An interval of numbers as a reader writes it ("[0, 1)": 0 allowed, 1 not), always finite, and why."""
    interval: str
    why: str

    def problem(self, value: Any) -> str | None:
        """'VALUE is outside the allowed range [0, 1) (why)' for a number outside (NaN and the infinities are), else
        None (a value of another type is left to the type check)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not in_interval(value, self.interval):
            return f"{_shown(value)} is outside the allowed range {self.interval} ({self.why})"
        return None


Range = IntRange | FloatRange


# The range of every integer option: (min, max, why). set_option checks it wherever an option is set (command
# line, TOML, a recorded config); check_ranges checks a Config built in Python. No real run comes near a max;
# each keeps what the value sizes (tensors, processes, threads, images kept) within a machine's memory.
INT_RANGES: dict[tuple[str, str], IntRange] = {
    ("data", "img_size"): IntRange(1, 2048, "data/preprocess.MAX_IMG_SIZE: a checkpoint of a larger input is refused"),
    ("data", "channels"): IntRange(1, 64, "data/preprocess.MAX_IN_CHANS: multispectral data has up to 13"),
    ("data", "max_shift"): IntRange(0, 2048, "a shift past the largest image pads it into a larger one"),
    ("data", "batch_size"): IntRange(1, 65536, "images per training step; the step trial allocates one batch: 2^16 "
                                       "images of 224 px are 37 GiB"),
    ("data", "workers"): IntRange(0, 256, "one DataLoader process each"),
    ("data", "max_pixels"): IntRange(0, 1 << 48, "a bound itself (0 = none), never taken from a recorded config"),
    ("data", "memory_limit_mb"): IntRange(0, 1 << 40, "a bound itself, never taken from a recorded config"),
    ("model", "exits"): IntRange(0, 16, "models/registry.MAX_EXITS"),
    ("optim", "accum_steps"): IntRange(1, 4096, "micro-batches per optimizer step"),
    ("optim", "freeze_first_bias_after_epochs"): IntRange(0, 1_000_000, "a number of epochs"),
    ("optim", "lookahead"): IntRange(0, 1_000_000, "steps between Lookahead syncs"),
    ("optim", "selective_backprop_after_epochs"): IntRange(0, 1_000_000, "a number of epochs"),
    ("train", "epochs"): IntRange(0, 1_000_000, "a number of epochs"),
    ("train", "seed"): IntRange(-(1 << 63), (1 << 64) - 1, "what torch.manual_seed takes"),
    ("train", "threads"): IntRange(0, 4096, "torch.set_num_threads: one OS thread each"),
    ("train", "log_every"): IntRange(0, 1_000_000_000, "a number of steps"),
    ("train", "early_stop"): IntRange(0, 1_000_000, "a number of epochs"),
    ("precision", "fp8_min_dim"): IntRange(0, 1 << 20, "a Linear's features"),
    ("parallel", "dist_timeout"): IntRange(1, 7 * 86400, "seconds: a week"),
    ("checkpoint", "save_every"): IntRange(0, 1_000_000_000, "a number of steps"),
    ("governance", "sample_grid"): IntRange(0, 256, "each sample is kept decoded at full resolution for the grid"),
}


# The range of every float option: an interval as a reader writes it ("[0, 1)": 0 allowed, 1 not) and why. Every
# value must also be finite: TOML and argparse both read inf and nan, and one of them in an option that sizes a
# schedule or a split is a traceback (int(inf)), in a bound a bound switched off (nan fails every comparison).
# Every upper end is finite, so inf is outside each interval, and in_interval's comparisons all fail on NaN.
FLOAT_RANGES: dict[tuple[str, str], FloatRange] = {
    ("data", "val_fraction"): FloatRange("[0, 1)", "a fraction of the training data; at 1 none would be left to "
                                                   "train on"),
    ("data", "random_erasing"): FloatRange("[0, 1]", "a probability"),
    ("data", "mixup"): FloatRange("[0, 1000]", "the alpha of a Beta(alpha, alpha); timm's recipes use 0.8"),
    ("data", "cutmix"): FloatRange("[0, 1000]", "the alpha of a Beta(alpha, alpha); timm's recipes use 1.0"),
    ("model", "drop_rate"): FloatRange("[0, 1]", "a dropout probability"),
    ("model", "drop_path"): FloatRange("[0, 1)", "a drop probability; at 1 every residual branch would be dropped"),
    ("model", "exit_threshold"): FloatRange("[0, 1]", "a softmax probability"),
    ("model", "whiten_eps"): FloatRange("(0, 1e6]", "added to eigenvalues before a square root is divided by"),
    ("optim", "lr"): FloatRange("[0, 1e30]", "a learning rate; one this large is how the non-finite step checks "
                                             "are tested"),
    ("optim", "layer_decay"): FloatRange("[0, 1]", "a factor per block from the head; 0 = off"),
    ("optim", "head_lr"): FloatRange("(0, 1e6]", "a multiple of --lr"),
    ("optim", "ema"): FloatRange("[0, 1)", "a decay; 0 = off"),
    ("optim", "weight_decay"): FloatRange("[0, 1e6]", "a decay coefficient"),
    ("optim", "momentum"): FloatRange("[0, 1)", "a momentum; at 1 or more the updates would never fade"),
    ("optim", "warmup_epochs"): FloatRange("[0, 1e6]", "a number of epochs, as --epochs"),
    ("optim", "label_smoothing"): FloatRange("[0, 1)", "the share of the target spread over all classes"),
    ("optim", "grad_clip"): FloatRange("[0, 1e12]", "a gradient norm; 0 = off"),
    ("optim", "bn_bias_lr_scale"): FloatRange("(0, 1e6]", "a multiple of --lr (airbench: 64)"),
    ("optim", "lookahead_alpha"): FloatRange("(0, 1]", "the share of the way the slow weights move"),
    ("optim", "selective_backprop"): FloatRange("[0, 1)", "a fraction of each batch; 0 = all of it"),
}


def in_interval(value: int | float, interval: str) -> bool:
    """Whether `value` lies in `interval` ("[0, 1)", "(0, 1e6]"): NaN and the infinities never do."""
    lo, hi = (float(end) for end in interval[1:-1].split(","))
    above = value > lo if interval[0] == "(" else value >= lo
    below = value < hi if interval[-1] == ")" else value <= hi
    return above and below and (not isinstance(value, float) or math.isfinite(value))


def _shown(value: int | float) -> str:
    return f"a number of {len(str(abs(value)))} digits" if type(value) is int and abs(value) >= 10**30 else repr(value)


def check_range(section: str, key: str, value: Any, origin: str) -> None:
    """A UserError naming the option, the value and its range when `value` is outside INT_RANGES or FLOAT_RANGES."""
    bound = INT_RANGES.get((section, key)) or FLOAT_RANGES.get((section, key))
    problem = bound.problem(value) if bound is not None else None
    if problem is not None:
        raise UserError(f"{origin}: [{section}] {key} = {problem}")


def check_ranges(cfg: Config, origin: str = "config") -> None:
    """INT_RANGES and FLOAT_RANGES over every option of `cfg` (one built or changed in Python, not through
    set_option)."""
    for section, key in [*INT_RANGES, *FLOAT_RANGES]:
        check_range(section, key, getattr(getattr(cfg, section), key), origin)


# The ranged options that the commands reading a checkpoint's config use: they choose the held-out images that
# evaluate scores and export checks parity on. One out of range is refused even there, never replaced by a default
# that would score other images (some of them training images) under the same split's name.
RECORDED_AND_USED = frozenset({("data", "val_fraction"), ("train", "seed")})


def in_range_only(raw: dict[str, Any], origin: str) -> dict[str, Any]:
    """`raw` without its values outside INT_RANGES or FLOAT_RANGES, each named in a warning, so this version's default
    stands in (RECORDED_AND_USED excepted: left for from_dict to refuse). For recorded configs: ranges were declared
    after checkpoints had been written with values such as `momentum = 1.0` or `lookahead_alpha = 2` (lookahead off),
    and the commands that read a checkpoint's config train nothing, so they never use those options."""
    kept: dict[str, Any] = {}
    for section, values in raw.items():
        if not isinstance(values, dict):
            kept[section] = values  # from_dict names the error
            continue
        kept[section] = {}
        for key, value in values.items():
            where = (moved_section(section, key), key)
            bound = INT_RANGES.get(where) or FLOAT_RANGES.get(where)
            problem = bound.problem(value) if bound is not None else None
            if problem is None or where in RECORDED_AND_USED:
                kept[section][key] = value
            else:
                warnings.warn(f"{origin}: [{where[0]}] {key} = {problem}; this version's default is used instead",
                              stacklevel=3)
    return kept


def set_option(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    """Set cfg.<section>.<key> = value with type, choice and range (INT_RANGES, FLOAT_RANGES) checks."""
    sub = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(sub)}
    if key not in fields:
        raise UserError(f"{origin}: unknown option '{key}' in [{section}]; known: {', '.join(fields)}")
    f = fields[key]
    t = field_type(f)
    if value is None and not takes_none(f):  # (a checkpoint's recorded config is JSON, which has null)
        raise UserError(f"{origin}: [{section}] {key} must be {t.__name__}, got null; leave it out for the default")
    if value is not None:
        if t is float and isinstance(value, int) and not isinstance(value, bool):
            check_range(section, key, value, origin)  # first: float() of an int of 310 digits is an OverflowError
            value = float(value)
        if not isinstance(value, t) or (t is int and isinstance(value, bool)):
            raise UserError(f"{origin}: [{section}] {key} must be {t.__name__}, got {value!r}")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise UserError(f"{origin}: [{section}] {key} must be one of {', '.join(choices)}, got {value!r}")
        check_range(section, key, value, origin)
    setattr(sub, key, value)
