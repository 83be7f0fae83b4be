"""The training sections of every config (data, model, optim, run) and their vocabulary: each field's type, range
(``Annotated[int, Field(ge=1)]``), choices (``Literal``) and meaning (its trailing ``# comment``: what ``--help``
prints), the checks across fields (``model_validator``), and in ``validate()`` what needs the file system or torch.
The machinery that reads, checks and words them is :mod:`patchplace.pipelines.config`."""

from __future__ import annotations

import json
import math
import re
import typing
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from patchplace.pipelines.config import FINITE, STRICT, ConfigError, Words, check, check_path

if typing.TYPE_CHECKING:
    from patchplace.data.remote import Network

# model.attention: patchplace.models.ATTENTION_KERNELS, written here so that --help imports no torch
# (tests/test_help_without_torch.py holds them equal)
Attention = Literal["sdpa", "math"]
ATTENTION_KERNELS = typing.get_args(Attention)
# data.frontend: patchplace.data.mfcc.FRONTENDS' names, written here so that --help imports no torch
Frontend = Literal["tf_speech_commands", "mp3_speech", "tc_resnet"]
# run.compile: torch.compile modes of every Transformer block (aot_eager: traced without code generation, a check)
CompileMode = Literal["no", "default", "reduce-overhead", "max-autotune", "aot_eager"]
# run.log_with: Accelerate's experiment trackers (accelerate.utils.LoggerType but "all"), with the package each needs
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet-ml", "aim": "aim",
            "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio"}
HOLDOUT = "holdout"  # data.val: the samples data.holdout keeps out of data.train
ReMode = Literal["const", "rand", "pixel"]  # data.re_mode: timm RandomErasing's fills
# data.interpolation: patchplace.data.transforms.INTERPOLATIONS (timm's / PIL's kernels), here for a torch-free --help
Interpolation = Literal["bicubic", "bilinear", "nearest", "box", "hamming", "lanczos"]
MAX_SIZE = 2**31  # model.overrides: an integer below this in magnitude (a tensor size torch takes as int32 / int64)
MAX_SEED = 2**31  # run.seed < this: rank r > 0 draws from a seed of its own above it (engine.rank_seed)
# what a model.preset names of a backbone (patchplace.models.BackboneConfig fields): its kind and size
PRESET_SIZE = ("modality", "embed_dim", "depth", "num_heads")

# timm's auto-augment policies (timm.data.auto_augment: rand_augment_transform, augment_and_mix_transform,
# auto_augment_transform), section by section as timm's parser reads them (KEY then digits; m, n, mmax, w, d as
# int(), mstd, p, a as float(); rand's t names a weighted op set): timm skips a section without a digit (rand-mXX
# trains at m10) and an unknown op set (rand-tfoo trains the default ops), asserts on an unknown key (a 40-line
# AssertionError) and clamps a magnitude above mmax (10), each without naming the key
_FLOAT = r"\d+(\.\d*)?"
_AUGMENT_SECTIONS = {
    "rand": rf"m\d+|n\d+|mstd{_FLOAT}|mmax\d+|inc[01]|p{_FLOAT}|t(weights|3aw|3a)",
    "augmix": rf"m\d+|w\d+|d\d+|a{_FLOAT}|b[01]|mstd{_FLOAT}",
    **dict.fromkeys(("original", "originalr", "v0", "v0r", "3a"), rf"mstd{_FLOAT}"),
}


def augment_problem(policy: str) -> str | None:
    """What is wrong with timm auto-augment policy ``policy`` (None: nothing), e.g. rand-m9-mstd0.5-inc1."""
    name, *sections = policy.split("-")
    if name not in _AUGMENT_SECTIONS:
        return f"timm's policies are {', '.join(_AUGMENT_SECTIONS)} (e.g. rand-m9-mstd0.5-inc1)"
    bad = [part for part in sections if not re.fullmatch(_AUGMENT_SECTIONS[name], part)]
    if bad:
        return f"timm cannot read {', '.join(bad)} of a {name} policy (it would skip it silently or fail on it): " \
               f"e.g. {'rand-m9-mstd0.5-inc1' if name == 'rand' else name}"
    values = {part[0]: float(part[1:]) for part in sections if re.fullmatch(r"m\d+", part)}
    ceiling = max([float(part[4:]) for part in sections if part.startswith("mmax")] or [10.0])
    if values.get("m", 0.0) > ceiling:
        return f"magnitude m{values['m']:g} is above timm's maximum {ceiling:g} (it would be clamped silently)"
    return None


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
Beta = Annotated[float, Field(ge=0, lt=1), Words("a beta", span="in [0, 1)")]  # AdamW's moment decays
Seed = Annotated[int, Field(ge=0, lt=MAX_SEED), Words(span="in [0, 2**31)")]


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
    # the training crop's and the evaluation resize's kernel (timm's names): bicubic (timm's default, DeiT, MAE,
    # MJP) | bilinear (torchvision's default: I-JEPA, StoP, VISSL's probes) | nearest | box | hamming | lanczos;
    # null: bicubic, and in evaluate.py the one the checkpoint recorded (the export uses the recorded one too). In
    # memory, training crops resample by grid_sample (bicubic, bilinear, nearest; the others stream) and
    # evaluation resizes are PIL's bit for bit
    interpolation: Interpolation | None = None
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
    # audio: the MFCC front end (patchplace.data.mfcc.FRONTENDS): tf_speech_commands (TensorFlow's speech_commands
    # example: 40 mel bands 20-4000 Hz, centred frames, 101 a second) | mp3_speech (MP3 §3.1 / Table 1: TC-ResNet's
    # training path, 64 bands 80-7600 Hz, 100 frames) | tc_resnet (TC-ResNet exactly: 98 frames); the checkpoint
    # records it, evaluation and export use the recorded one
    frontend: Frontend = "tf_speech_commands"
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
        if self.auto_augment and (problem := augment_problem(self.auto_augment)):
            raise ConfigError(f"data.auto_augment={self.auto_augment}: {problem}")
        if self.repeated_aug > self.batch_size:
            # DeiT's RASampler deals an image's copies into one step (3 in a batch of 1024); more copies than a
            # batch holds fill batches with one image (without a shuffle buffer, only it) and the epoch reads
            # 1 / repeated_aug of the images
            raise ConfigError(f"data.repeated_aug={self.repeated_aug} copies of each image exceed data.batch_size="
                              f"{self.batch_size}, the batch that should hold them beside other images (DeiT: 3 in "
                              f"1024): set data.repeated_aug <= {self.batch_size} or a larger data.batch_size")
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

    @model_validator(mode="after")
    def _cross(self) -> ModelSection:
        """An integer override no tensor size can hold is named here (torch would answer "Overflow when unpacking
        long long", naming no key)."""
        for name, value in (getattr(self, "overrides", None) or {}).items():
            if isinstance(value, int) and not isinstance(value, bool) and not -MAX_SIZE < value < MAX_SIZE:
                raise ConfigError(f"model.overrides.{name}={value} is beyond any model's size (an integer of magnitude "
                                  f"< 2**31): set model.overrides.{name} to the architecture's value")
        return self

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

    def validate_overrides(self, keys: Collection[str]) -> None:
        """A ``model.preset`` the command line sets beside a checkpoint must name the checkpoint's own
        (:func:`names_checkpoint`): any other would be ignored, the checkpoint bringing its architecture. A config
        file's preset is its from-scratch baseline, and a checkpoint given on the command line replaces it."""
        if "model.preset" in keys and self.checkpoint and not names_checkpoint(self.preset, Path(self.checkpoint)):
            raise ConfigError(f"model.preset={self.preset} cannot apply to model.checkpoint={self.checkpoint}: a "
                              "checkpoint brings its architecture; drop model.preset")


def names_checkpoint(preset: str, folder: Path) -> bool:
    """Whether ``preset`` names the save_pretrained() ``folder``: the preset its config.json records
    (``metadata.preset``), else a preset of its size (:data:`PRESET_SIZE`: a patch size or another override at
    pretraining leaves the preset it started from). True where config.json cannot be read (the loader says why)."""
    try:
        saved = json.loads((folder / "config.json").read_text())
        recorded, backbone = saved["metadata"].get("preset"), dict(saved["backbone"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True
    if recorded is not None:
        return preset == recorded
    from patchplace.models import PRESETS  # (imports torch)

    return preset in PRESETS and all(getattr(PRESETS[preset], k) == backbone.get(k) for k in PRESET_SIZE)


@dataclass
class OptimSection:
    """AdamW (timm) or Adam, a warm-up, then cosine decay (or a step / constant lr); optionally a cosine weight
    decay (engine/schedules.py)."""

    epochs: float = 1.0  # passes over data.train (fractions allowed)
    # run.resume=true with a larger optim.epochs / optim.max_steps extends the run: replan (the schedule planned
    # over the new budget, as HF Trainer's and timm's --resume: from the resumed step on, the lr is the new
    # schedule's) | phase (a new phase from the resumed step: warm-up and schedule over the added steps)
    extend: Literal["replan", "phase"] = "replan"
    # stop after this many optimizer steps (overrides epochs)
    max_steps: Annotated[int, Field(ge=1), Words(note="(or null: train optim.epochs)")] | None = None
    lr: Annotated[float, Field(gt=0), FINITE] = 1e-3  # peak learning rate (AdamW), after the linear warm-up
    weight_decay: Annotated[float, Field(ge=0), FINITE] = 0.05  # AdamW; none on norms, biases, PEs and tokens
    betas: tuple[Beta, Beta] = (0.9, 0.999)  # AdamW betas
    warmup_fraction: Rate = 0.05  # fraction of the steps spent warming the lr up linearly
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.01  # the cosine ends at lr x this
    clip_grad: Annotated[float, Field(gt=0), FINITE, Words("a norm", "(null: off)")] | None = 1.0  # gradient-norm clip
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
    # clearml, dvclive, swanlab, trackio, or all (every one installed); each gets train/*, val/* and the config as
    # its params, the run named after run.output, and is set up as it usually is (its environment: WANDB_MODE=offline,
    # MLFLOW_TRACKING_URI=file:mlruns with MLFLOW_ALLOW_FILE_STORE=true, ...; docs/pipelines.md), e.g. [wandb]
    log_with: tuple[str, ...] | str = ()  # trackers beside run.tensorboard: a name, a list, or all (docs/pipelines.md)
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
    # torch.compile mode: no | default | reduce-overhead (CUDA graphs) | max-autotune | aot_eager (traced, no code
    # generated: a check). A GPU knob: a small ViT's step is launch-bound there (results/benchmark.md); on a CPU
    # compiling costs more than it saves
    compile: CompileMode = "no"
    # what run.compile compiles: blocks (every Transformer block in place, regional; weight names unchanged) | step
    # (the objective's whole forward and backward as one graph, fullgraph: with reduce-overhead one CUDA graph a step)
    compile_scope: Literal["blocks", "step"] = "blocks"
    # recompute every Transformer block's activations (the backbone's, the decoders' / predictors') in the backward
    # instead of keeping them (torch.utils.checkpoint, non-reentrant: dropout / drop path replayed, the same loss and
    # gradients): the memory of ViT-L / ViT-H at a larger batch, for about one more forward of the blocks per step
    # (results/benchmark_activation_memory.md)
    activation_checkpointing: bool = False
    # shard the weights, gradients and AdamW state over the processes (Accelerate's FSDP2, a unit per Transformer
    # block): off | full_shard (ZeRO-3: each block's weights gathered for its forward and again for its backward) |
    # shard_grad_op (ZeRO-2: kept from the forward to the backward). A GPU knob (refused on CPUs, where Accelerate
    # runs DDP); checkpoints hold the full state and resume as DDP's; not with run.model_ema, nor in
    # finetune.py (docs/scale-out.md)
    fsdp: Literal["off", "full_shard", "shard_grad_op"] = "off"
    # when a non-finite loss is looked for: step (every step, a host sync: the run stops before the step reaches the
    # weights) | lazy (no per-step sync, a GPU knob: the flags stay on the device, a bad step's update is skipped
    # inside AdamW's fused kernel, and the run stops with the same one line at the next log, checkpoint or
    # evaluation, before anything is saved; needs optim.fused and not fp16) | auto (lazy on a GPU with the fused
    # AdamW and without fp16, else step)
    finite_check: Literal["auto", "step", "lazy"] = "auto"
    # EMA of the weights, this decay per optimizer step (timm ModelEmaV3, e.g. DeiT's 0.99996): resumed exactly,
    # saved in output/ema/ and evaluated at the end (val/ema_*) beside the trained weights; null: off
    model_ema: Annotated[float, Field(gt=0, lt=1), Words("a decay", "(e.g. 0.99996; null: off)")] | None = None

    __pydantic_config__ = STRICT
    key: ClassVar[str] = "run"

    @model_validator(mode="after")
    def _cross(self) -> RunSection:
        """Fields that hold together, and the snapshot epochs (one message naming every bad one)."""
        if isinstance(self.log_with, str):
            self.log_with = (self.log_with,)
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
        unknown = [t for t in self.log_with if t not in TRACKERS and t != "all"]
        if unknown:
            raise ConfigError(f"run.log_with: unknown tracker(s) {', '.join(map(str, unknown))}; Accelerate's: "
                              f"{', '.join(TRACKERS)}")
        if not self.log_with:
            return
        from accelerate.tracking import get_available_trackers  # only when asked for: --help and defaults skip it

        available = {str(t) for t in get_available_trackers()}
        missing = [t for t in self.log_with if t not in available and t != "all"]
        if missing:
            raise ConfigError(f"run.log_with={missing[0]} needs the {TRACKERS[missing[0]]} package, which is not "
                              f"installed here: pip install {TRACKERS[missing[0]]}")

