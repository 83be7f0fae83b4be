"""Pipeline configs: YAML files in ``pipelines/configs/`` + ``section.field=value`` overrides on the command line,
read as YAML 1.2 by ruamel.yaml (:func:`parse_yaml`) into dataclasses that declare their fields' types, ranges
(``Annotated[int, Field(ge=1)]``), choices (``Literal``) and cross-field checks (``model_validator``), which
pydantic enforces strictly (:func:`build`, :func:`check`; :func:`problem` words its refusal). Unknown keys, wrong
types, bad ranges and missing datasets fail up front with one line naming the key; so do a key given twice, a
YAML error or object tag (:func:`yaml_problem`), ``${...}`` interpolation and ``.nan`` (:func:`_checked`), and a path
the file system cannot hold (:func:`check_path`).

``--help`` (:func:`parser`) lists the fields with the values that command line would run with (``--config`` and
overrides applied, each such value marked) in at most :data:`HELP_WIDTH` columns. A command that reads a section of
a training config in part declares its own smaller section class and ``shares: ClassVar[dict[str, type]]``
({section: the training section class}): a shared config file still loads, the fields it never reads
(:func:`unread_fields`) are accepted, ignored and named at the end of its --help."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import json
import math
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AllowInfNan, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from ruamel.yaml import YAML
from ruamel.yaml.constructor import DuplicateKeyError
from ruamel.yaml.error import YAMLError
from ruamel.yaml.nodes import MappingNode, SequenceNode

from patchplace.data.helpformat import HELP_WIDTH, help_formatter

if typing.TYPE_CHECKING:
    from patchplace.data.remote import Network

# model.attention: patchplace.models.ATTENTION_KERNELS, written here so that --help imports no torch
# (tests/test_help_without_torch.py holds them equal)
Attention = Literal["sdpa", "math"]
ATTENTION_KERNELS = typing.get_args(Attention)
# run.compile: torch.compile modes of every Transformer block (aot_eager: traced without code generation, a check)
CompileMode = Literal["no", "default", "reduce-overhead", "max-autotune", "aot_eager"]
COMPILE_MODES = typing.get_args(CompileMode)
# run.log_with: Accelerate's experiment trackers (accelerate.utils.LoggerType but "all"), with the package each needs
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet-ml", "aim": "aim",
            "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio"}
HOLDOUT = "holdout"  # data.val: the samples data.holdout keeps out of data.train
ReMode = Literal["const", "rand", "pixel"]  # data.re_mode: timm RandomErasing's fills
MAX_SEED = 2**31  # run.seed < this: rank r > 0 draws from a seed of its own above it (engine.rank_seed)
HELP_COLUMN = 44  # where a field's meaning starts in --help ("  section.field = value" before it)
# every section: pydantic checks values of the field's type (no coercion: "yes" is no bool), unknown keys refused
STRICT = ConfigDict(strict=True, extra="forbid")


class ConfigError(ValueError):
    """A config file or override is wrong (names the key and what is expected)."""


@dataclass(frozen=True)
class Words:
    """How a bounded field's one-line message (:func:`field_problem`) names what it takes (``what``: "a
    probability") and a note after its range ("(0: off)"); pydantic ignores it."""

    what: str = ""
    note: str = ""


FINITE = AllowInfNan(False)  # inf (YAML .inf) refused too
Count = Annotated[int, Field(ge=1)]
Integer = Annotated[int, Field(ge=1), Words("an integer")]
Size = Annotated[int, Field(ge=0)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
Rate = Annotated[float, Field(ge=0, lt=1)]
Probability = Annotated[float, Field(ge=0, le=1), Words("a probability")]
Alpha = Annotated[float, Field(ge=0), Words(note="(0: off)")]
Lr = Annotated[float, Field(ge=0), FINITE, Words("an lr")]
Seed = Annotated[int, Field(ge=0, lt=MAX_SEED)]


def one_line(exc: BaseException) -> str:
    """The message of a user error on one line. A DataLoader worker's error comes back as "Caught DataError in
    DataLoader worker process 0. Original Traceback ...": its last line is the original message."""
    text = str(exc).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last and "Error" in last.split(": ", 1)[0] else last
    return " ".join(text.split())


def check_path(key: str, path: str) -> None:
    """A :class:`ConfigError` for a path this file system cannot hold, before anything is created or read."""
    from patchplace.data.atomic import path_problem

    if problem := path_problem(key, path):
        raise ConfigError(problem)


@dataclass
class DataSection:
    """Shards and the input pipeline (see patchplace.data)."""

    # split directory with manifest.json, or its URL: http(s)://, s3://, gs://, hf://, ... (docs/data.md)
    train: str = "shards/fashion_mnist/train"
    # split the training-time evaluation (and evaluate.py) reads; "holdout": the data.holdout samples of data.train
    val: str = "shards/fashion_mnist/test"
    train_urls: str | None = None  # optional override: brace pattern or pipe: URLs of the same shards
    val_urls: str | None = None  # the same for data.val
    batch_size: Count = 128  # per process
    # training: drop each epoch's ragged tail, so every step has the full per-process batch (false: one short batch)
    drop_last: bool = True
    num_workers: Size = 2  # streaming only: DataLoader worker processes
    shuffle_buffer: Size = 5000  # streaming only
    in_memory: bool | str = "auto"  # auto | true | false: hold splits in memory, augment batches on the device
    memory_budget_mb: NonNegative = 4096  # auto: the decoded splits (train + val) must fit this, per process
    pad_to: int | None = 32  # images: zero-pad (28 -> 32 for patch 4)
    img_size: int | None = None  # images: resize/crop side (default: native or padded side)
    scale: tuple[float, float] = (0.35, 1.0)  # RandomResizedCrop area range
    hflip: float = 0.5  # horizontal flip probability (training)
    auto_augment: str | None = None  # timm auto-augment policy, e.g. rand-m9-mstd0.5 (streaming path only)
    re_prob: float = 0.0  # random erasing probability (timm RandomErasing)
    re_mode: ReMode = "const"  # random erasing fill (timm): const (zeros) | rand (per channel) | pixel (DeiT)
    re_count: Integer = 1  # random erasing: up to this many boxes per image (timm max_count)
    # evaluation splits (data.val, evaluate.py): resize the short side to img_size / crop_pct (bicubic), centre crop
    # img_size, as timm's eval transform (ImageNet: 0.875, DeiT / MAE); < 1 streams data.val
    crop_pct: Annotated[Fraction, Words(note="(ImageNet: 0.875)")] = 1.0
    # repeated augmentation (DeiT, arXiv 2012.12877): each streamed training sample is read this many times,
    # independently augmented, in an epoch of unchanged length (~1 / N of the distinct images; DeiT: 3). Unlike
    # timm's RASampler the copies stay on one rank (the shuffle buffer mixes them); > 1 streams data.train
    repeated_aug: Integer = 1
    # I-JEPA / StoP pretraining (arXiv 2301.08243; StoP: flip, grayscale 0.2, blur 0.5, scale [0.3, 1]), after the
    # crop / flip, streamed: RandomGrayscale probability (channels kept)
    grayscale: Probability = 0.0
    gaussian_blur: Probability = 0.0  # I-JEPA's PIL Gaussian blur probability (radius ~ U(0.1, 2)), streamed
    # I-JEPA's colour distortion strength s: ColorJitter(.8s, .8s, .8s, .2s) with p 0.8 (0: off), streamed
    color_jitter: Alpha = 0.0
    # Mixup alpha (0: off) of the training batches of methods trained with labels (supervised, mjp; timm Mixup,
    # soft targets smoothed by objective.label_smoothing); finetune.py mixes with finetune.mixup instead
    mixup: Alpha = 0.0
    cutmix: Alpha = 0.0  # CutMix alpha (0: off); as data.mixup
    mixup_prob: Probability = 1.0  # probability of mixing a batch (data.mixup / data.cutmix)
    mixup_switch_prob: Probability = 0.5  # with both alphas > 0: probability of CutMix rather than Mixup
    noise_split: str | None = None  # audio: background_noise split for noise mixing
    train_limit: int | None = None  # cap on samples per process per epoch (None: the whole split)
    # train on a fixed class-balanced fraction of data.train (e.g. 0.01: 1%)
    label_fraction: Annotated[Fraction, Words(note="(e.g. 0.01 for 1% of the labels)")] | None = None
    label_subset_seed: int = 0  # which balanced subset (the same for every method and run)
    skip_corrupt: bool = False  # skip unreadable / truncated train shards (warned, counted in the log), not fail
    verify_shards: bool = True  # check each shard's size + sha256 against its manifest when read (~1% of a load)
    timeout: Positive = 60.0  # splits / shards by URL (http(s), s3): seconds a connection or a read may wait
    # URLs (http(s), object stores): further attempts after a transient failure (connection refused / reset,
    # timeout, HTTP 429 / 5xx, throttling), 1 s apart, doubling; a 404 / 403 / missing bucket or key fails at once
    retries: Size = 4
    # URLs: seconds one shard's (or manifest's) whole transfer may take, however steadily its bytes trickle in; a
    # transfer still going prints a progress line (bytes so far, rate) every 30 s
    shard_deadline: Annotated[Positive, Words(note="(seconds: one shard's whole transfer; default 600)")] = 600.0
    val_limit: int | None = None  # evaluate on the first N samples of data.val (None: all)
    # a validation split held out of data.train: N class-balanced samples (data.holdout_seed) that training never
    # reads; data.val=holdout evaluates on them (recipe choices read validation, the test split is read once);
    # with data.val=<test split> they are still kept out of data.train (a final evaluation on the same train images)
    holdout: Size = 0
    holdout_seed: int = 0  # which samples are held out (the same for every method and run)

    __pydantic_config__ = STRICT
    key: ClassVar[str] = "data"

    @model_validator(mode="after")
    def _cross(self) -> DataSection:
        """Fields that hold together (checked by pydantic after the fields' own types and ranges)."""
        if self.in_memory not in ("auto", True, False):
            raise ConfigError(f"data.in_memory must be auto, true or false, got {self.in_memory!r}")
        if self.val == HOLDOUT and self.holdout <= 0:
            raise ConfigError(f"data.val=holdout needs data.holdout > 0 (got {self.holdout}): hold samples out of "
                              "data.train to validate on them")
        if self.color_jitter and self.auto_augment:
            raise ConfigError(f"data.color_jitter={self.color_jitter} (I-JEPA's) and data.auto_augment="
                              f"{self.auto_augment} (timm's) both distort colour: set one")
        return self

    def validate(self) -> None:
        """The declared checks (:func:`check`), then the splits: a URL's backend installed, a folder's manifest."""
        check(self)
        # (imported here: patchplace.data imports torch, and --help reads this module)
        from patchplace.data.manifest import dataset_dir_hint
        from patchplace.data.remote import is_remote
        from patchplace.data.stores import backend_problem

        for name in ("train", "val", "train_urls", "val_urls", "noise_split"):  # a URL whose backend is missing
            problem = backend_problem(str(getattr(self, name) or ""))
            if problem:
                raise ConfigError(f"data.{name}: {problem}")
        for name in ("train", "val") if self.val != HOLDOUT else ("train",):
            if is_remote(getattr(self, name)):  # a URL (http(s), s3, gs, hf, ...): its manifest is fetched later
                continue
            check_path(f"data.{name}", getattr(self, name))
            path = Path(getattr(self, name))
            if not (path / "manifest.json").is_file():
                hint = dataset_dir_hint(path)
                if hint:
                    raise ConfigError(f"data.{name}: {hint}")
                raise ConfigError(f"data.{name}: no manifest.json in {path}; build the shards first (make data, or "
                                  f"python data/fashion_mnist.py --out {path.parent})")

    def network(self) -> Network:
        """How splits and shards are fetched by URL (data.timeout, data.retries, data.shard_deadline)."""
        from patchplace.data.remote import Network

        return Network(self.timeout, self.retries, deadline=self.shard_deadline)


@dataclass
class ModelSection:
    """Backbone: a preset of patchplace.models plus overrides, or a pretrained checkpoint (fine-tuning)."""

    preset: str = "vit_cpu"  # patchplace.models preset (vit_cpu, vit_cpu_narrow, vit_tiny, ..., audio_mp3)
    overrides: dict[str, Any] = field(default_factory=dict)  # BackboneConfig fields, e.g. {embed_dim: 128}
    checkpoint: str | None = None  # save_pretrained() directory to start from
    # attention kernel: sdpa (fused where the device has it) | math (the materialised softmax of the papers' time,
    # e.g. to measure MP3 Table 2 in its setting); the same numbers either way
    attention: Attention = "sdpa"

    __pydantic_config__ = STRICT
    key: ClassVar[str] = "model"

    def validate(self) -> None:
        """The declared checks (:func:`check`), then the checkpoint: a folder that holds one, no overrides."""
        check(self)
        if not self.checkpoint:
            return
        check_path("model.checkpoint", self.checkpoint)
        if getattr(self, "overrides", None):  # (evaluate.py's model section has none)
            given = "{" + ", ".join(f"{k}: {v}" for k, v in self.overrides.items()) + "}"
            raise ConfigError(f"model.overrides={given} cannot apply to model.checkpoint={self.checkpoint}: "
                              "a checkpoint brings its architecture; drop model.overrides (or set finetune.* / "
                              "model.attention), or train model.preset from scratch without model.checkpoint")
        folder = Path(self.checkpoint)
        if folder.is_dir() and not (folder / "config.json").exists() and (folder / "checkpoint").exists():
            best = f", or {folder / 'best'} (its best evaluation)" if (folder / "best").is_dir() else ""
            raise ConfigError(f"model.checkpoint={self.checkpoint} is a training run's folder, not a checkpoint: use "
                              f"model.checkpoint={folder / 'checkpoint'} (its last checkpoint){best}")


@dataclass
class OptimSection:
    """AdamW (timm) or Adam, a warm-up, then cosine decay (or a step / constant lr); optionally a cosine weight
    decay (engine/schedules.py)."""

    epochs: float = 1.0  # passes over data.train (fractions allowed)
    # stop after this many optimizer steps (overrides epochs)
    max_steps: Annotated[int, Field(ge=1), Words(note="(or null: train optim.epochs)")] | None = None
    lr: Annotated[float, Field(gt=0), FINITE] = 1e-3  # peak learning rate (AdamW), after the linear warm-up
    weight_decay: Annotated[float, Field(ge=0), FINITE] = 0.05  # AdamW; none on norms, biases, PEs and tokens
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    warmup_fraction: Rate = 0.05  # fraction of the steps spent warming the lr up linearly
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.01  # the cosine ends at lr x this
    clip_grad: float | None = 1.0  # gradient-norm clipping (None: off)
    layer_decay: Fraction | None = None  # layer-wise lr decay (fine-tuning, e.g. 0.75)
    # none | linear | sqrt: rescale optim.lr from optim.lr_base_batch to the run's global batch (data.batch_size x
    # processes x run.grad_accum): linear (Goyal et al. 2017; MAE's blr x batch / 256) or square root
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    # the global batch optim.lr was tuned at (null: data.batch_size x run.grad_accum)
    lr_base_batch: Count | None = None
    # AdamW's fused kernel (one launch for every parameter's update; the same update rule): null = on a GPU only
    fused: bool | None = None
    # adamw | adam: torch.optim.Adam on the same groups (MP3's speech recipe, arXiv 2207.07611 §4.3); adam needs
    # optim.weight_decay=0 (Adam's decay is an L2 term in the gradient, not AdamW's decoupled decay)
    optimizer: Literal["adamw", "adam"] = "adamw"
    # the lr after the warm-up: cosine (down to optim.final_lr, else lr x optim.min_lr_ratio) | step (x
    # optim.step_gamma every optim.step_every steps) | constant (the peak lr)
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    # warm-up length in optimizer steps (overrides optim.warmup_epochs and optim.warmup_fraction; MP3 speech: 500)
    warmup_steps: Size | None = None
    # warm-up length in epochs of data.train, as papers state it (e.g. 40, 15, 5; overrides optim.warmup_fraction)
    warmup_epochs: Annotated[float, Field(ge=0), FINITE, Words("a number")] | None = None
    # absolute lr of the first warm-up step, rising linearly to the peak (timm's warmup_lr_init; I-JEPA / StoP's
    # start_lr 2e-4 -> lr 8e-4); not rescaled by optim.lr_scaling; null: from peak / warm-up steps
    start_lr: Lr | None = None
    # linear | constant: the lr stays at optim.start_lr through the warm-up, then jumps to the peak (MP3 speech
    # §4.3: 500 steps at 1e-4, then 1e-3)
    warmup_mode: Literal["linear", "constant"] = "linear"
    # absolute lr the cosine ends at (overrides optim.min_lr_ratio; I-JEPA final_lr 1e-6, DeiT min_lr 1e-5); not
    # rescaled by optim.lr_scaling
    final_lr: Lr | None = None
    # optim.schedule=step: optimizer steps between two lr drops, counted from the warm-up's end (MP3 speech: 10000)
    step_every: int | None = None
    step_gamma: Fraction = 0.5  # optim.schedule=step: the lr's factor at each drop (MP3 speech: halved)
    # cosine weight decay from optim.weight_decay to this over the run, on the groups that decay (I-JEPA / StoP's
    # CosineWDSchedule: 0.04 -> 0.4); null: constant
    weight_decay_end: NonNegative | None = None

    __pydantic_config__ = STRICT
    key: ClassVar[str] = "optim"

    @model_validator(mode="after")
    def _cross(self) -> OptimSection:
        """The length, the optimizer and its weight-decay schedule (fields that hold together)."""
        if self.epochs <= 0 and not self.max_steps:
            raise ConfigError(f"optim.epochs must be > 0 (or set optim.max_steps), got {self.epochs}")
        if self.optimizer == "adam" and self.weight_decay:
            raise ConfigError(f"optim.optimizer=adam takes no weight decay (Adam's is an L2 term in the gradient, not "
                              f"AdamW's decoupled decay): set optim.weight_decay=0 (got {self.weight_decay}), or use "
                              "optim.optimizer=adamw")
        if self.weight_decay_end is not None and not self.weight_decay > 0:
            raise ConfigError(f"optim.weight_decay_end must be >= 0 with optim.weight_decay > 0 (the cosine runs from "
                              f"it on the groups that decay), got {self.weight_decay_end} and {self.weight_decay}")
        return self._cross_schedule()

    def _cross_schedule(self) -> OptimSection:
        """The warm-up and the lr schedule's fields that hold together (each names itself and the fix)."""
        if self.warmup_mode == "constant" and self.start_lr is None:
            raise ConfigError("optim.warmup_mode=constant holds the lr at optim.start_lr through the warm-up: set "
                              "optim.start_lr (e.g. 1e-4)")
        if self.final_lr is not None and self.schedule != "cosine":
            raise ConfigError(f"optim.final_lr is where the cosine ends: it has no effect with optim.schedule="
                              f"{self.schedule}; set it to null")
        if self.schedule == "step" and (self.step_every is None or self.step_every < 1):
            raise ConfigError(f"optim.schedule=step needs optim.step_every >= 1 (steps between lr drops), got "
                              f"{self.step_every}")
        if self.schedule != "step" and self.step_every is not None:
            raise ConfigError(f"optim.step_every is read by optim.schedule=step only (got {self.schedule}); set it to "
                              "null")
        return self

    def validate(self) -> None:
        check(self)

    def scaled_lr(self, global_batch: int, default_base: int) -> float:
        """The peak lr of a run at ``global_batch`` under ``lr_scaling`` (``default_base``: the base batch when
        ``lr_base_batch`` is null)."""
        ratio = global_batch / (self.lr_base_batch or default_base)
        return self.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]


@dataclass
class RunSection:
    """Output, seeds, precision, logging, checkpoint cadence, learning-curve snapshots and early stopping."""

    output: str = "runs/default"  # run directory (log.jsonl, checkpoints, tensorboard/)
    # weights, data order, augmentation; masks / noise / drop path: a stream per (seed, rank) (several processes:
    # seed < 2**20, engine.rank_seed)
    seed: Seed = 0
    # no | fp16 | bf16 | auto: bf16 where the device trains faster in it and bf16 training was tested equivalent
    # (a GPU with bf16; a CPU with AMX bf16 units), else no; printed at start, recorded in the run's metadata
    # (engine/hardware.py: on a CPU without bf16 units a bf16 step runs ~15x slower than float32); fp16 is a GPU
    # precision: on a CPU Accelerate trains float32, and the run prints and records no
    mixed_precision: Literal["no", "fp16", "bf16", "auto"] = "no"
    grad_accum: Count = 1  # micro-batches per optimizer step
    log_every: Count = 10  # steps
    checkpoint_every: Size = 0  # steps; 0 = only at the end
    eval_every: Size = 0  # steps; 0 = only at the end
    resume: bool = False  # continue from the newest complete checkpoint in output/checkpoints (if any)
    overwrite: bool = False  # replace the run already in run.output (without it, reusing a directory is an error)
    tensorboard: bool = True  # events in output/tensorboard/ (train/*, val/*)
    # experiment trackers beside run.tensorboard, by Accelerate's names: tensorboard, wandb, mlflow, comet_ml, aim,
    # clearml, dvclive, swanlab, trackio; each gets train/* and val/* as TensorBoard does and is set up as it
    # usually is (its environment: WANDB_MODE=offline, MLFLOW_TRACKING_URI=file:mlruns, ...), e.g. [wandb]
    log_with: tuple[str, ...] = ()
    log_project: str = "patchplace"  # the run.log_with trackers' project (W&B, Comet, Aim) / experiment (MLflow)
    # DDP's find_unused_parameters; null = only for objectives whose steps may leave a trainable parameter without
    # gradient (MJP's E_unk). True costs a graph traversal per step (results/benchmark.md, ddp suite).
    find_unused_parameters: bool | None = None
    # learning curves: the backbone after each of these epochs is kept in output/snapshots/epoch-<e>/ (0: the
    # initial weights, the random-init control), e.g. [0, 0.5, 1, 2]; each is also a regular checkpoint step
    keep_epochs: tuple[float, ...] = ()
    # stop after this many evaluations (run.eval_every) without a better run.early_stop_metric (0: off; needs a
    # pipeline that evaluates: finetune.py). output/best/ holds the best evaluation's backbone: evaluate that one.
    # The cosine lr schedule still spans optim.epochs: an early stop cuts it short
    early_stop_patience: Annotated[int, Field(ge=0), Words(note="(0: off)")] = 0
    early_stop_metric: str = "top1"  # what early stopping follows: higher is better, lower if its name has "loss"
    # torch.compile every Transformer block in place (regional compilation; weight names unchanged): no | default |
    # reduce-overhead (CUDA graphs) | max-autotune | aot_eager (traced, no code generated: a check). A GPU knob: a
    # small ViT's step is launch-bound there (results/benchmark.md); on a CPU compiling costs more than it saves
    compile: CompileMode = "no"
    # when a non-finite loss is looked for: step (every step, a host sync: the run stops before the step reaches the
    # weights) | lazy (no per-step sync, a GPU knob: the flags stay on the device, a bad step's update is skipped
    # inside AdamW's fused kernel, and the run stops with the same one line at the next log, checkpoint or
    # evaluation, before anything is saved; needs optim.fused and not fp16)
    finite_check: Literal["step", "lazy"] = "step"
    # EMA of the weights, this decay per optimizer step (timm ModelEmaV3, e.g. DeiT's 0.99996): resumed exactly,
    # saved in output/ema/ and evaluated at the end (val/ema_*) beside the trained weights; null: off
    model_ema: Annotated[float, Field(gt=0, lt=1), Words("a decay", "(e.g. 0.99996; null: off)")] | None = None

    __pydantic_config__ = STRICT
    key: ClassVar[str] = "run"

    @model_validator(mode="after")
    def _cross(self) -> RunSection:
        """Fields that hold together, and the snapshot epochs (one message naming every bad one)."""
        bad = [e for e in self.keep_epochs if not (math.isfinite(e) and e >= 0)]
        if bad:
            raise ConfigError(f"run.keep_epochs holds {', '.join(f'{e:g}' for e in bad)}: epochs must be finite and "
                              ">= 0, e.g. [0, 0.5, 1, 2]")
        if self.finite_check == "lazy" and self.mixed_precision == "fp16":
            raise ConfigError("run.finite_check=lazy skips a bad step in AdamW's fused kernel, and fp16's loss scaler "
                              "skips steps of its own: use run.mixed_precision=bf16 or no, or run.finite_check=step")
        if self.early_stop_patience and not self.eval_every:
            raise ConfigError(f"run.early_stop_patience={self.early_stop_patience} counts evaluations, and "
                              "run.eval_every=0 evaluates only at the end: set run.eval_every (steps) too")
        return self

    def validate(self) -> None:
        """The declared checks (:func:`check`), then run.output's path and the trackers' packages."""
        check(self)
        check_path("run.output", self.output)
        self._validate_trackers()

    def _validate_trackers(self) -> None:
        """run.log_with: Accelerate's names, each with its package installed (Accelerate would leave one out)."""
        unknown = [t for t in self.log_with if t not in TRACKERS]
        if unknown:
            raise ConfigError(f"run.log_with: unknown tracker(s) {', '.join(map(str, unknown))}; Accelerate's: "
                              f"{', '.join(TRACKERS)}")
        if not self.log_with:
            return
        from accelerate.tracking import get_available_trackers  # only when asked for: --help and defaults skip it

        available = {str(t) for t in get_available_trackers()}
        missing = [t for t in self.log_with if t not in available]
        if missing:
            raise ConfigError(f"run.log_with={missing[0]} needs the {TRACKERS[missing[0]]} package, which is not "
                              f"installed here: pip install {TRACKERS[missing[0]]}")


def _yaml() -> YAML:
    """ruamel.yaml's safe loader: YAML 1.2's core schema (only true / false are bools, so ``run.mixed_precision=no``
    stays the string "no"; ``1e-9`` is a float), plain values only (no object tags), each key once."""
    return YAML(typ="safe", pure=True)


def parse_yaml(text: str) -> Any:
    """YAML 1.2 text of a config file or an override value (:func:`_yaml`)."""
    return _yaml().load(text)


def yaml_problem(exc: YAMLError, text: str, fix: str) -> str:
    """``line L, column C: what is wrong`` with YAML ``text`` and how to fix it (``fix`` for a syntax error), on
    one line."""
    problem = " ".join((getattr(exc, "problem", None) or one_line(exc)).split())
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, DuplicateKeyError):  # YAML 1.2 requires it; PyYAML kept the last (stop, then mae: MAE)
        key = re.search(r'duplicate key "(.*?)" with', problem)
        key = key.group(1) if key else problem
        problem = f"key {key!r} is given twice ({_first_at(text, key, exc.context_mark)}YAML would keep the " \
                  "last silently): keep one"
    elif problem.startswith("could not determine a constructor for the tag"):  # !!python/object and the like
        tag = problem.rsplit(" ", 1)[-1].strip("'").replace("tag:yaml.org,2002:", "!!")
        problem = (f"the tag {tag} would build an object, and a config holds plain values (numbers, strings, lists, "
                   "mappings): remove the tag")
    else:
        problem = f"not valid YAML ({problem}): {fix}"
    return (f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else "") + problem


def _first_at(text: str, key: str, mapping: Any) -> str:
    """``first at line N; `` for the first ``key`` of the mapping that starts at mark ``mapping`` in ``text``."""
    nodes = [_yaml().compose(text)]
    while nodes:
        node = nodes.pop()
        if isinstance(node, MappingNode) and (node.start_mark.line, node.start_mark.column) == (
                mapping.line, mapping.column):
            line = next((k.start_mark.line + 1 for k, _ in node.value if k.value == key), None)
            return f"first at line {line}; " if line else ""
        if isinstance(node, MappingNode):
            nodes += [n for pair in node.value for n in pair]
        elif isinstance(node, SequenceNode):
            nodes += node.value
    return ""


def _leaves(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of the leaves of a nested mapping (``{a: {b: 1}}`` -> ``{"a.b": 1}``; an empty mapping
    is a leaf)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _within(key: str, prefix: str) -> bool:
    """Whether dotted ``key`` is ``prefix`` or lies under it."""
    return key == prefix or key.startswith(prefix + ".")


def unread_fields(cls: type) -> list[str]:
    """The fields (``section.field``) of the sections ``cls`` shares with other commands that it never reads:
    ``cls.shares`` maps a section to the shared class (a training config's), whose fields ``cls``'s own, smaller
    section class lacks. A shared config file loads; these are accepted and ignored."""
    hints = typing.get_type_hints(cls)
    return [f"{section}.{f.name}" for section, shared in getattr(cls, "shares", {}).items()
            for f in fields(shared) if f.name not in {g.name for g in fields(hints[section])}]


def shipped_configs() -> Path:
    """The folder of the shipped configs (in the installed package, else pipelines/configs/ of a checkout)."""
    from patchplace.pipelines import _configs  # at call time: as a path from the working directory now

    return _configs()


def config_path(name: str) -> Path:
    """``--config NAME``: an existing file first, else the shipped config of that name (``.yaml`` optional), so the
    console scripts find them from any folder; neither: one line listing the shipped names."""
    check_path("--config", name)
    if Path(name).is_file():
        return Path(name)
    shipped = shipped_configs()
    for candidate in (shipped / name, shipped / f"{name}.yaml"):
        if Path(name).name == name and candidate.is_file():  # a bare name only: a path stays the user's path
            return candidate
    names = sorted(p.name for p in shipped.glob("*.yaml")) if shipped.is_dir() else []
    raise ConfigError(f"config file {name} not found, and no shipped config has that name; shipped ({shipped}): "
                      f"{', '.join(names) or 'none'}")


def command_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config`` file, the ``section.field=value`` overrides) of a command line, as :func:`parser` reads
    them (other options are left out)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("overrides", nargs="*")
    args, _ = p.parse_known_intermixed_args(argv)  # (in any order, as the main parser takes them)
    return args.config, [a for a in args.overrides if "=" in a]


def given_setting(argv: list[str], key: str) -> Any:
    """The value a command line gives dotted ``key``: its override's, else its ``--config`` file's; None if
    neither sets it."""
    file, given = given_values(None, *command_args(argv))
    return {**file, **given}.get(key)


def given_values(cls: type | None, path: str | None, overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """({dotted key: value} the ``--config`` file gives, the same for the ``section.field=value`` overrides). An
    override replaces what the file gives at its key (a mapping as a whole); the :func:`unread_fields` of config
    class ``cls`` are left out."""
    file: dict[str, Any] = {}
    if path:
        path = str(config_path(path))
        raw = _parsed(Path(path).read_bytes(), f"config file {path}", "fix the file") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: expected a mapping (section: {{field: value}}), got {raw!r}")
        file = _checked(_leaves(raw), f" (in {path})")
    given: dict[str, Any] = {}
    for assignment in overrides:
        if "=" not in assignment:
            raise ConfigError(f"override {assignment!r} must look like section.field=value")
        key, text = assignment.split("=", 1)
        key = key.strip()
        for leaves in (file, given):
            for old in [k for k in leaves if _within(k, key) or _within(key, k)]:
                del leaves[old]
        value = _parsed(text, f"override {assignment!r}", "quote or fix the value")
        given.update(_checked(_leaves({key: value}), ""))
    unread = unread_fields(cls) if cls is not None else []
    file, given = ({k: v for k, v in leaves.items() if not any(_within(k, u) for u in unread)}
                   for leaves in (file, given))
    return file, given


def _parsed(text: str | bytes, what: str, fix: str) -> Any:
    """YAML ``text`` of a config file (bytes) or an override value, or a :class:`ConfigError` naming ``what`` and
    where its text is wrong (a syntax error, a key given twice, an object tag, bytes that are not UTF-8) in one
    line."""
    try:
        return parse_yaml(text.decode() if isinstance(text, bytes) else text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text (byte {exc.start}): {fix}") from None
    except YAMLError as exc:
        raise ConfigError(f"{what}, {yaml_problem(exc, text if isinstance(text, str) else text.decode(), fix)}") \
            from None


def _checked(leaves: dict[str, Any], where: str) -> dict[str, Any]:
    """``leaves`` ({dotted key: value}) once no value is NaN (no field takes one: ``optim.lr: .nan`` reached the
    optimizer) and no string holds ``${`` outside a ``pipe:`` command (interpolation is not a feature
    of these configs: ``${data.train}/x`` would be taken literally and create a folder of that name; a shell
    expands ``${VAR}`` in a ``pipe:`` command)."""
    for key, value in leaves.items():
        for item in _scalars(value):
            if isinstance(item, float) and math.isnan(item):
                raise ConfigError(f"{key}{where}: .nan is not a value any field takes: give a number")
            if isinstance(item, str) and "${" in item and not item.startswith("pipe:"):
                raise ConfigError(f"{key}={item}{where}: ${{...}} interpolation is not expanded in a config (the "
                                  "text would be taken literally): write the value out (a shell variable is "
                                  "expanded in a pipe: command only)")
    return leaves


def _scalars(value: Any) -> list[Any]:
    """The values inside a list / mapping value, or the value itself."""
    if isinstance(value, list | tuple):
        return [s for v in value for s in _scalars(v)]
    return [s for v in value.values() for s in _scalars(v)] if isinstance(value, dict) else [value]


def build(cls: type, given: dict[str, Any]) -> Any:
    """The ``cls`` instance with the values ``given`` ({dotted key: value}) over its defaults, as pydantic
    validates it (:func:`_adapter`); what it refuses is one :class:`ConfigError` line (:func:`problem`).

    The values go into the defaults of ``cls()`` (a section given in part keeps its owner's: ``optim.max_steps=5``
    on the pretraining config keeps its ``OptimSection(lr=1.5e-3, betas=(0.9, 0.95))``). Each section declares
    its fields' types, ranges and choices (``Annotated`` / ``Literal``), ``extra="forbid"`` and its cross-field
    checks (``model_validator``); strict: a value must have its field's type already (an int for a float and a
    list for a tuple aside: "yes" or 1 is no bool, 3 no str). What needs the file system or torch (a split's
    manifest, a tracker's package, the registered method) is the sections' ``validate()``. A field nothing sets
    keeps its default object (pydantic makes ``memory_budget_mb: float = 4096`` 4096.0, which config.yaml would
    show)."""
    for key, value in given.items():  # YAML's values pydantic's JSON lacks (a date) in a mapping field
        if any(not isinstance(v, bool | int | float | str | None) for v in _scalars(value)):
            raise ConfigError(_wrong(cls, key, given))
    values = dataclasses.asdict(cls())
    for key, value in given.items():
        *parents, name = key.split(".")
        place = values
        for part in parents:
            place[part] = place[part] if isinstance(place.get(part), dict) else {}
            place = place[part]
        place[name] = value
    try:
        config = _adapter(cls).validate_json(json.dumps(values), strict=True)
    except ValidationError as exc:
        raise ConfigError(problem(cls, exc, given)) from None
    _defaults_kept(config, cls(), given)
    return config


def check(section: Any) -> None:
    """The checks ``section`` (a dataclass instance with a ``key`` such as "optim") declares, by pydantic, as
    :func:`build` runs them: for a section built in code (``OptimSection(schedule="step").validate()``)."""
    try:
        _adapter(type(section)).validate_json(json.dumps(dataclasses.asdict(section), default=str), strict=True)
    except ValidationError as exc:
        raise ConfigError(problem(type(section), exc, {}, f"{section.key}.")) from None


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    """pydantic's validator of config class ``cls`` (its dataclasses, their type hints and validators); a section
    class that declares no pydantic config (another package's, e.g. research's) gets :data:`STRICT` too."""
    sections = [cls]
    while sections:
        section = sections.pop()
        if "__pydantic_config__" not in vars(section):
            section.__pydantic_config__ = STRICT
        sections += [hint for hint in typing.get_type_hints(section).values() if is_dataclass(hint)]
    return TypeAdapter(cls)


def problem(cls: type, exc: ValidationError, given: dict[str, Any], prefix: str = "") -> str:
    """pydantic's first refusal of config class ``cls`` as one line naming the key (``prefix`` + its place):
    unknown keys all together with the section's fields; a cross-field check's own :class:`ConfigError`; a range
    or choice as :func:`field_problem` words it; a wrong type as ``key: expected <type>, got <value>``."""
    errors = exc.errors()
    unknown = list(dict.fromkeys(prefix + ".".join(map(str, e["loc"])) for e in errors
                                 if e["type"] == "unexpected_keyword_argument"))
    if unknown:
        section = _section(cls, unknown[0][len(prefix):].rpartition(".")[0])
        return f"unknown config key(s) {unknown}; known: {sorted(f.name for f in fields(section))}"
    error = errors[0]
    if isinstance(cause := (error.get("ctx") or {}).get("error"), ConfigError):
        return str(cause)
    key = _field_key(cls, error["loc"])  # a tuple's item, a union's member: its field
    if error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
                         "literal_error"):
        return prefix + field_problem(_hint(cls, key), key, error["input"])
    return prefix + _wrong(cls, key, given or {key: error["input"]})


def _field_key(cls: type, loc: tuple[Any, ...]) -> str:
    """The dotted field of config class ``cls`` that pydantic's error location ``loc`` lies in."""
    parts: list[str] = []
    for part in loc:
        if not (is_dataclass(cls) and part in {f.name for f in fields(cls)}):
            break
        parts.append(part)
        cls = typing.get_type_hints(cls)[part]
    return ".".join(parts)


def _hint(cls: type, key: str) -> Any:
    """The type hint of dotted field ``key`` of ``cls``, its ``Annotated`` metadata kept."""
    for part in key.split("."):
        cls = typing.get_type_hints(cls, include_extras=True)[part]
    return cls


def field_problem(hint: Any, key: str, value: Any) -> str:
    """``key must be [what] <its choices or range> [note], got value``: the words of a field's declared
    ``Literal`` or ``Ge`` / ``Gt`` / ``Le`` / ``Lt`` bounds and :class:`Words` (of an item, for a tuple)."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is tuple:
        hint = typing.get_args(hint)[0]
    meta = [m for a in (typing.get_args(hint)[1:] if typing.get_origin(hint) is Annotated else ())
            for m in getattr(a, "metadata", [a])]  # a Field's bounds, one object each
    words = next((m for m in meta if isinstance(m, Words)), Words(note="(a finite number)" * (FINITE in meta)))
    note = words.note or ("(or null)" if optional else "")
    hint = typing.get_args(hint)[0] if meta else hint
    if typing.get_origin(hint) is Literal:
        choices = ", ".join(map(str, typing.get_args(hint)))
        return " ".join(filter(None, [f"{key} must be one of {choices}", note])) + f", got {value!r}"
    bounds = {name: getattr(m, name) for m in meta for name in ("ge", "gt", "le", "lt") if hasattr(m, name)}
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}" if "gt" in bounds else ""
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})" if "lt" in bounds else ""
    if low and high:
        span = f"in {low}, {high}".replace(str(MAX_SEED), "2**31")
    elif low:
        span = (">= " if low[0] == "[" else "> ") + low[1:]
    else:
        span = ("<= " if high[-1:] == "]" else "< ") + high[:-1] if high else ""
    return " ".join(filter(None, [f"{key} must be", words.what, span, note])) + f", got {value!r}"


def load(cls: type, path: str | None, overrides: list[str]) -> Any:
    """YAML file (optional) + overrides -> validated ``cls`` instance."""
    file, given = given_values(cls, path, overrides)
    config = build(cls, {**file, **given})
    validate(config)
    return config


def _section(cls: type, key: str) -> Any:
    """The section class at dotted ``key`` of config class ``cls`` ("": ``cls``); None inside a mapping field."""
    for part in filter(None, key.split(".")):
        cls = typing.get_type_hints(cls).get(part) if is_dataclass(cls) else None
    return cls if is_dataclass(cls) else None


def _wrong(cls: type, key: str, given: dict[str, Any]) -> str:
    """``key: expected <the field's type>, got <the value given>``."""
    parent, _, name = key.rpartition(".")
    section = _section(cls, parent)
    hint = typing.get_type_hints(section).get(name) if section else None  # (its Annotated bounds left out)
    if _section(cls, key):
        expected = "a mapping"
    elif hint is None:  # inside a mapping field: a value YAML has and JSON lacks
        expected = "a number, string, bool, list or mapping"
    else:
        expected = _type_text(hint)
    value = given[key] if key in given else {k[len(key) + 1:]: v for k, v in given.items() if _within(k, key)}
    return f"{key}: expected {expected}, got {value!r}"


def _type_text(hint: Any) -> str:
    """A type hint as its source writes it (``float | None``, ``tuple[float, float]``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is not None or not hasattr(hint, "__name__"):
        return str(hint).replace("typing.", "")
    return "None" if hint is type(None) else hint.__name__


def _defaults_kept(config: Any, default: Any, given: Collection[str], prefix: str = "") -> None:
    """Every field of ``config`` that no key of ``given`` sets back to the object ``default`` holds."""
    for f in fields(config):
        name, value = prefix + f.name, getattr(config, f.name)
        if is_dataclass(value):
            _defaults_kept(value, getattr(default, f.name), given, name + ".")
        elif not any(_within(k, name) for k in given):
            setattr(config, f.name, getattr(default, f.name))


def validate(config: Any) -> None:
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            validate(value)
    if hasattr(config, "validate"):
        config.validate()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """What each field of a dataclass means, read from its source (:func:`source_docs`); a subclass's words win."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        docs.update(source_docs(lines, {f.name for f in fields(klass)}, klass.__doc__))
    return {k: v for k, v in docs.items() if v}


def source_docs(lines: list[str], names: Collection[str], docstring: str | None) -> dict[str, str]:
    """{field: meaning} of the fields ``names`` of a class whose source is ``lines``: the comment after the field
    (or the comment lines right above it), else a ``name``: text entry of the class ``docstring`` (the objectives'
    configs)."""
    comments, docs, seen = {}, {}, set()
    for token in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0] - 1] = token.string.lstrip("#").strip()
    for i, line in enumerate(lines):
        match = re.match(r"\s+(\w+)\s*:", line)
        if not match or match.group(1) not in names or match.group(1) in seen:
            continue
        seen.add(match.group(1))
        text = comments.get(i) if comments.get(i) and not line.strip().startswith("#") else None
        above, j = [], i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            above.insert(0, comments.get(j, ""))
            j -= 1
        docs[match.group(1)] = text or " ".join(above)
    for name, text in re.findall(r"``(\w+)``:\s*(.+?)(?=;\s*``|\.?\s*$|\.\s)", " ".join(
            (docstring or "").split()), flags=re.S):
        if name in names and not docs.get(name):
            docs[name] = text.strip()
    return docs


def describe(config: Any, prefix: str = "", sources: dict[str, str] | None = None) -> list[str]:
    """One entry per field with its value and what it means (for --help); ``config`` is a dataclass type or
    instance. An entry fits :data:`HELP_WIDTH` columns and may span lines: the meaning wraps under itself (from
    :data:`HELP_COLUMN`, below the value when the value is too wide to leave room beside it). ``sources``:
    {dotted key: where its value comes from} (:func:`help_values`), shown after the value."""
    instance = config() if isinstance(config, type) else config
    docs, lines = field_docs(type(instance)), []
    for f in fields(instance):
        name, value = prefix + f.name, getattr(instance, f.name)
        if is_dataclass(value):
            lines += describe(value, f"{name}.", sources)
        else:
            lines.append(field_entry(name, value, docs.get(f.name), source_of(sources or {}, name)))
    return lines


def field_entry(name: str, value: Any, doc: str | None, source: str | None = None) -> str:
    """``  name = value  (source)`` and ``# doc`` beside it from :data:`HELP_COLUMN`, wrapped to
    :data:`HELP_WIDTH` columns (the doc's continuation lines aligned under its first)."""
    left = f"  {name} = {value!r}" + (f"  ({source})" if source else "")
    head = textwrap.wrap(left, HELP_WIDTH, subsequent_indent=" " * 6, break_on_hyphens=False) \
        if len(left) > HELP_WIDTH else [left]
    if not doc:
        return "\n".join(head)
    text = textwrap.wrap(doc, HELP_WIDTH - HELP_COLUMN - 3, break_on_hyphens=False)
    if len(head) == 1 and len(left) <= HELP_COLUMN:  # the meaning beside the value
        lines = [f"{left:<{HELP_COLUMN}} # {text[0]}"]
        text = text[1:]
    else:
        lines = head
    return "\n".join([*lines, *(f"{'':<{HELP_COLUMN}} # {t}" for t in text)])


def source_of(sources: dict[str, str], name: str) -> str | None:
    """Where the value of field ``name`` comes from: its own key, or (a mapping field such as ``model.overrides``)
    a key inside it."""
    if name in sources:
        return sources[name]
    return next((where for key, where in sources.items() if key.startswith(name + ".")), None)


def help_values(cls: type, argv: list[str]) -> tuple[Any, dict[str, str], str]:
    """What --help shows for this command line: (the ``cls`` instance its ``--config`` file and overrides give, not
    validated; {dotted key: "from file" (the ``--config`` file) or "override"} for every value they set; the
    header naming them). A file or override that does not load leaves the code defaults, and the header says why."""
    path, overrides = command_args(argv)
    header = "config fields (override with section.field=value)"
    if not path and not overrides:
        return cls(), {}, header + ":"
    try:
        file, given = given_values(cls, path, overrides)
        config = build(cls, {**file, **given})
    except (OSError, ValueError, TypeError) as exc:
        what = " and ".join([*([f"--config {path}"] if path else []), *(["the overrides"] if overrides else [])])
        return cls(), {}, f"{header}; the code defaults ({what} not applied: {one_line(exc)}):"
    marks = [*([f'"(from file)" by --config {path}'] if path else []), *(['"(override)" by the command line']
                                                                          if overrides else [])]
    sources = {**dict.fromkeys(file, "from file"), **dict.fromkeys(given, "override")}
    return config, sources, f"{header} with the values in force: the code defaults, changed where marked " \
                            f"{' and '.join(marks)}:"


def help_epilog(cls: type, argv: list[str]) -> str:
    """The config part of --help: every field a command reads (its :func:`unread_fields` named at the end) with
    its value in force (:func:`help_values`) and meaning, then what the class adds for this command line
    (``help_fields(argv)``, e.g. the chosen objective's fields; ``help_fields(argv, config, sources)`` when it takes
    the values in force too)."""
    config, sources, header = help_values(cls, argv)
    unused = unread_fields(cls)
    lines = [header, *describe(config, sources=sources)]
    if unused:
        lines += ["", *textwrap.wrap("not read by this command (accepted, so that a shared config loads): "
                               + ", ".join(unused), HELP_WIDTH, break_on_hyphens=False)]
    if hasattr(cls, "help_fields"):
        takes = len(inspect.signature(cls.help_fields).parameters)
        lines += cls.help_fields(argv, config, sources) if takes >= 3 else cls.help_fields(argv)
    return "\n".join(lines)


class HelpFormatter(help_formatter(argparse.RawDescriptionHelpFormatter)):  # type: ignore[misc]
    """Keeps the line breaks of the description and epilog (a module docstring, the field list) and fits them to
    :data:`HELP_WIDTH` columns (patchplace.data.helpformat: every command line's width): a paragraph with a longer
    line is filled again, a longer command example (an indented ``python`` / ``accelerate`` line) continues on the
    next line after a backslash."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in fit_lines(text.splitlines(), HELP_WIDTH - len(indent)))


def fit_lines(lines: list[str], width: int = HELP_WIDTH) -> list[str]:
    """``lines`` fitted to ``width`` columns (see :class:`HelpFormatter`); lines that fit are kept as they are."""
    out: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        if any(len(line) > width for line in paragraph):
            out.extend(textwrap.wrap(" ".join(paragraph), width, break_on_hyphens=False))
        else:
            out.extend(paragraph)
        paragraph.clear()

    for line in lines:
        if line.strip() and not line[0].isspace():  # prose: gathered into its paragraph
            paragraph.append(line)
            continue
        flush()
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        if re.match(r"\s+(python|accelerate|torchrun)\b", line):  # a command: still one after copy and paste
            command, _, comment = line.strip().partition("  #")
            if comment.strip():  # its comment above it: a backslash would not continue a comment
                out.append(f"{indent}# {comment.strip()}")
            parts = textwrap.wrap(command.strip(), width - 2, initial_indent=indent, subsequent_indent=indent + "    ",
                                  break_long_words=False, break_on_hyphens=False)
            out.extend([f"{part} \\" for part in parts[:-1]] + parts[-1:])
        else:
            out.extend(textwrap.wrap(line.strip(), width, initial_indent=indent, subsequent_indent=indent,
                                     break_on_hyphens=False))
    flush()
    return out


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog is written when help is asked for (it reads the --config file)."""

    def __init__(self, *args: Any, epilog_of: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epilog_of = epilog_of

    def format_help(self) -> str:
        if self.epilog is None and self.epilog_of is not None:
            self.epilog = self.epilog_of()
        return super().format_help()


def parser(cls: type, description: str, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """``--config`` + overrides; ``--help`` lists every field the command reads with the value in force for this
    command line (the code default, or its ``--config`` file's / an override's, marked so) and its meaning, plus
    what the config class adds (:func:`help_epilog`), in at most :data:`HELP_WIDTH` columns."""
    argv = list(argv or [])
    p = _Parser(description=description, formatter_class=HelpFormatter, epilog_of=lambda: help_epilog(cls, argv))
    p.add_argument("--config", help="YAML file, or a shipped config's name (pipelines/configs/*.yaml, e.g. "
                                    "mp3_fashion_mnist)")
    p.add_argument("overrides", nargs="*", help="section.field=value, e.g. data.batch_size=64 run.output=runs/x")
    return p


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
