"""The config classes of the command lines (pretrain.py, finetune.py, evaluate.py): the sections of sections.py
plus each command's own, importable without torch so that ``--help`` starts in a second (what they validate
against that lives beside torch, e.g. the registered methods, is imported when they validate)."""

from __future__ import annotations

import textwrap
import typing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from patchplace.data.helpformat import HELP_WIDTH
from patchplace.objectives.declarations import known_methods
from patchplace.pipelines.config import STRICT, ConfigError, Words, check
from patchplace.pipelines.help import field_docs, field_entry, help_values, source_of
from patchplace.pipelines.sections import (
    Attention,
    Count,
    DataSection,
    Fraction,
    ModelSection,
    OptimSection,
    Positive,
    Probability,
    Rate,
    RunSection,
    Seed,
    Size,
)

if TYPE_CHECKING:
    from patchplace.finetune import AttackConfig, ProbeRecipe
    from patchplace.objectives import ObjectiveConfig

    Objective = dict[str, Any] | ObjectiveConfig
else:  # what a file or override gives: pydantic types it, torch-free (the method's class needs torch)
    Objective = dict[str, Any]


@dataclass
class PretrainConfig:
    """``method`` picks the objective; ``objective`` holds its config fields (paper defaults otherwise): as read
    from the file and overrides, the fields given; once validated, the registered method's own config object (e.g.
    ``MP3Config(eta=0.5, anchor_ratio=0.0)``: :meth:`objective_config`), which config.yaml records field by field."""

    method: str = "mp3"  # a registered method (listed at the end of --help)
    objective: Objective = field(default_factory=dict)  # the method's fields (listed below), e.g. {eta: 0.5}
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1.5e-3, betas=(0.9, 0.95)))
    run: RunSection = field(default_factory=lambda: RunSection(output="runs/pretrain"))

    __pydantic_config__ = STRICT

    @staticmethod
    def help_fields(argv: list[str], config: PretrainConfig | None = None,
                    sources: dict[str, str] | None = None) -> list[str]:
        """--help: the objective fields of the method in force (``config``: the command line's --config and
        overrides, else read from ``argv``; mp3 where its method is not registered), with their values and what
        each means (the torch-free :mod:`patchplace.objectives.configs`)."""
        if config is None:
            config, sources, _ = help_values(PretrainConfig, argv)
        registered = known_methods()
        method = config.method if config.method in registered else "mp3"
        spec = registered[method]
        defaults, docs = spec.config_values(), field_docs(spec.config_cls)
        given = config.objective if isinstance(config.objective, dict) and set(config.objective) <= set(
            defaults) else {}  # unknown fields: the defaults (the run would refuse them)
        values = {**defaults, **given}
        entries = [field_entry(f"objective.{name}", value, docs.get(name),
                               source_of(sources or {}, f"objective.{name}")) for name, value in values.items()]
        return [f"objective fields of method={method} (objective.field=value; another method: method=<name> "
                "--help):", *entries, "",
                *textwrap.wrap(f"methods: {', '.join(registered)}", HELP_WIDTH, break_on_hyphens=False)]

    def validate(self) -> None:
        from patchplace.objectives import get_method, method_names  # (imports torch)

        if self.method not in method_names():
            raise ConfigError(f"method {self.method!r} is not one of {method_names()}")
        self.objective = self.objective_config()  # unknown / mistyped / out-of-range fields fail here
        if (self.data.mixup or self.data.cutmix) and not get_method(self.method).needs_head:
            labelled = ", ".join(n for n in method_names() if get_method(n).needs_head)
            raise ConfigError(f"data.mixup={self.data.mixup} / data.cutmix={self.data.cutmix} mix labels, and method="
                              f"{self.method} trains without them: set both to 0 (methods trained with labels: "
                              f"{labelled})")

    def objective_config(self) -> Any:
        """The registered method's config (e.g. ``MP3Config``) the ``objective`` section gives: the config class's
        defaults, then the registration's (``stop``: I-JEPA's with ``stop=True``), then the given fields, typed
        strictly as every section is (:func:`~patchplace.pipelines.config.build`: "0.5x" is no float, 1 no bool)
        and checked by the class; what it refuses is one line naming ``objective.<field>``. An ``objective`` that
        is the config object already (validated) is that object."""
        from patchplace.objectives import ObjectiveError, get_method  # (imports torch)
        from patchplace.pipelines.config import build

        spec = get_method(self.method)
        if not isinstance(self.objective, dict):
            return spec.config(self.objective)
        names = [f.name for f in fields(spec.config_cls)]
        unknown = [f"objective.{name}" for name in self.objective if name not in names]
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; method={self.method} knows: {sorted(names)}")
        # the given fields' types, then the class checks the values: both name a field as its key, objective.eta
        typed = build(spec.config_cls, self.objective, prefix="objective.")
        try:
            return spec.config({name: getattr(typed, name) for name in self.objective}, named="objective.{}".format)
        except ObjectiveError as exc:
            raise ConfigError(str(exc)) from None

    def objective_values(self) -> dict[str, Any]:
        """{field: value} of :meth:`objective_config`: every field in force once validated (what a run's metadata
        records), the given fields before."""
        if isinstance(self.objective, dict):
            return dict(self.objective)
        return {f.name: getattr(self.objective, f.name) for f in fields(self.objective)}



# mean_fc_norm: MAE's / DropPos's --global_pool (MAE models_vit.py; timm global_pool='avg', fc_norm=True): the mean
# of the patch tokens through a fresh LayerNorm fc_norm, the final norm after the blocks dropped
Pool = Literal["cls", "mean", "mean_fc_norm"]
POOLS = typing.get_args(Pool)
POOL_WORDS = {"cls": "the class token", "mean": "average-pooled patch tokens",
              "mean_fc_norm": "average-pooled patch tokens through a LayerNorm (fc_norm, no final norm)"}


@dataclass
class FinetuneSection:
    """Fine-tuning recipe (DeiT / MAE style, scaled to small data)."""

    pos_embed: str | None = "learned"  # PE for fine-tuning; None keeps the checkpoint's mode
    # where a learned PE starts: random (trunc-normal .02 when the PE mode changes; a table of the same mode is kept)
    # | sincos2d (the fixed 2-D sin-cos values, trainable: MAE's fine-tuning) | checkpoint (the checkpoint's table)
    pos_embed_init: str = "random"
    # cls | mean | mean_fc_norm (the mean through a fresh LayerNorm, no final norm: MAE's / DropPos's --global_pool):
    # the feature the head reads; None: the checkpoint's finetune_pool
    global_pool: Annotated[Pool, Words(note="(or null: the checkpoint's finetune_pool)")] | None = None
    drop_path: Rate = 0.1  # stochastic depth rate (timm DropPath, linear over the blocks)
    label_smoothing: Rate = 0.1  # of the (soft) targets
    mixup: float = 0.8  # Mixup alpha (0: off; timm Mixup)
    cutmix: float = 1.0  # CutMix alpha (0: off)
    mixup_prob: Probability = 1.0  # probability of mixing a batch at all

    __pydantic_config__ = STRICT
    key: ClassVar[str] = "finetune"

    @model_validator(mode="after")
    def _cross(self) -> FinetuneSection:
        """A PE start other than random needs a learned PE."""
        if self.pos_embed_init != "random" and self.pos_embed != "learned":
            raise ConfigError(f"finetune.pos_embed_init={self.pos_embed_init} starts a learned PE: set "
                              f"finetune.pos_embed=learned (got {self.pos_embed})")
        return self

    def validate(self) -> None:
        """The declared checks (:func:`check`), then finetune.pos_embed_init's choices (patchplace.finetune's)."""
        check(self)
        from patchplace.finetune.setup import POS_EMBED_INITS  # (patchplace.finetune imports torch)

        if self.pos_embed_init not in POS_EMBED_INITS:
            raise ConfigError(f"finetune.pos_embed_init must be one of {POS_EMBED_INITS}, got {self.pos_embed_init!r}")


@dataclass
class FinetuneConfig:
    """``model.checkpoint`` = a pretrain run's checkpoint/ (empty: train ``model.preset`` from scratch)."""

    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-3, layer_decay=0.75))
    run: RunSection = field(default_factory=lambda: RunSection(output="runs/finetune"))

    __pydantic_config__ = STRICT

    @model_validator(mode="after")
    def _cross(self) -> FinetuneConfig:
        """pretrain.py's mixing fields left at their defaults (fine-tuning mixes with its own)."""
        d = self.data
        if d.mixup or d.cutmix or (d.mixup_prob, d.mixup_switch_prob) != (1.0, 0.5):
            raise ConfigError("data.mixup / data.cutmix / data.mixup_prob / data.mixup_switch_prob are pretrain.py's; "
                              "fine-tuning mixes with finetune.mixup / finetune.cutmix / finetune.mixup_prob")
        return self


@dataclass
class EvalSection:
    """What to compute (each can be switched off), with how much data, and the linear probe's recipe
    (docs/pipelines.md#evaluation-protocols: MAE / RandSAC's LARS, StoP / I-JEPA's VISSL SGD and 1% logistic
    regression)."""

    linear_probe: bool = True  # linear classifier on frozen features, 100% (eval.probe_layers) and low-label
    knn: bool = True  # kNN top-1 per layer (MP3 App. C)
    position_probe: bool = True  # linear probe of each patch token's position (DropPos Table 7)
    consistency_ratios: tuple[float, ...] = (0.03, 0.09, 0.15, 0.27, 0.5)  # MJP eval gammas (classifiers)
    # train samples the probes (and the kNN) train on, drawn at random (run.seed) from data.train; 0 or null: the
    # whole split (features are streamed through a store on disk: memory does not grow with it)
    probe_train_samples: Size | None = 5000
    probe_epochs: int = 100  # epochs of each linear probe (MAE / RandSAC 90, VISSL 28)
    # a second probe (eval.label_probe) on this class-balanced fraction of the probe's samples (StoP: 1%); 0: none
    low_label_fraction: Annotated[float, Field(ge=0, le=1)] = 0.01
    # linear probes trained on these class-balanced fractions of the *whole* data.train (the label-efficiency
    # protocol: the same subsets as fine-tuning with data.label_fraction, picked by data.label_subset_seed)
    label_fractions: tuple[Annotated[Fraction, Words(note="(e.g. [0.01, 0.1])")], ...] = ()
    # one probe (eval.label_probe) per file listing train samples, one name a line: SimCLR's ImageNet
    # 1percent.txt / 10percent.txt (n01440764_10026.JPEG), or paths under the split folder
    label_subset_files: tuple[str, ...] = ()
    # the low-label probes (low_label_fraction, label_fractions, label_subset_files): linear (the recipe below) |
    # logistic (StoP's 1% protocol, logistic_eval.py: multinomial L2 logistic regression, standardized features)
    label_probe: Literal["linear", "logistic"] = "linear"
    logistic_lambda: Positive = 0.0025  # label_probe=logistic: L2 lambda, divided by the sample count (StoP README)
    # features of the 100% linear probe: last (the final-normed last block) and / or last4 (the last 4 blocks,
    # each final-normed and pooled, concatenated: StoP Table 1 "100%, last 4 layers")
    probe_layers: tuple[Literal["last", "last4"], ...] = ("last",)
    # bn_linear: BatchNorm without affine + Linear (MAE) | bn_affine_linear: BatchNorm + Linear (VISSL
    # eval_mlp) | linear
    probe_head: str = "bn_linear"
    probe_optimizer: str = "adamw"  # adamw | lars (MAE / RandSAC: timm's Lars) | sgd (Nesterov momentum: VISSL)
    probe_lr: float = 1e-2  # absolute, or per eval.probe_lr_batch samples when that is > 0 (MAE 0.1, VISSL 0.01)
    probe_lr_batch: int = 0  # > 0: lr = probe_lr x probe_batch / this (256: MAE, VISSL); 0: probe_lr is absolute
    probe_batch: int = 256  # the probe's batch, on one process (MAE 16384, VISSL 256)
    probe_warmup_epochs: float = 0.0  # linear warm-up from 0 (MAE / RandSAC 10)
    # cosine: half cycle to 0 by fractional epoch (MAE) | step: x eval.probe_lr_gamma at each milestone (VISSL)
    probe_schedule: str = "cosine"
    probe_milestones: tuple[int, ...] = ()  # probe_schedule=step: the epochs of the lr drops (VISSL 8, 16, 24)
    probe_lr_gamma: float = 0.1  # probe_schedule=step: the lr's factor at each milestone
    probe_weight_decay: float = 0.0  # never on BatchNorm parameters (MAE / RandSAC 0, VISSL 5e-4)
    probe_momentum: float = 0.9  # lars / sgd momentum
    probe_init_std: float = 0.0  # > 0: trunc-normal linear weight of this std, zero bias (MAE 0.01); 0: torch's
    keep_features: bool = False  # keep run.output/features/ (each split's stored features, .npy) after evaluating
    max_eval_samples: int = 2000  # images for the method curves (eta curve, DropPos grid, consistency)

    __pydantic_config__ = STRICT
    key: ClassVar[str] = "eval"

    def validate(self) -> None:
        """The declared checks (:func:`check`), then the probe's recipe (patchplace.finetune's checks)."""
        check(self)
        if not self.probe_layers:
            raise ConfigError("eval.probe_layers must list last and / or last4, got []")
        try:
            self.recipe().validate()
        except ValueError as exc:
            raise ConfigError(f"eval.probe_*: {exc}") from None

    def recipe(self) -> ProbeRecipe:
        """The linear probe's recipe these fields give."""
        from patchplace.finetune import ProbeRecipe  # (imports torch)

        return ProbeRecipe(head=self.probe_head, optimizer=self.probe_optimizer, lr=self.probe_lr,
                           lr_batch=self.probe_lr_batch, batch_size=self.probe_batch, epochs=self.probe_epochs,
                           warmup_epochs=self.probe_warmup_epochs, schedule=self.probe_schedule,
                           milestones=tuple(self.probe_milestones), gamma=self.probe_lr_gamma,
                           weight_decay=self.probe_weight_decay, momentum=self.probe_momentum,
                           init_std=self.probe_init_std)


@dataclass
class PrivacySection:
    """Gradient-inversion privacy evaluation (MJP §5.4, Table 5): which images and settings, plus the
    gradient-matching attack's own fields (patchplace.finetune's ``AttackConfig``: steps, lr, distance, tv_weight,
    optimizer, ...: written out here in its order, so that --help imports no torch; tests/test_help_without_torch.py
    holds them equal)."""

    steps: int = 200  # gradient-matching attack (a CPU budget)
    lr: float = 0.1  # attack optimizer step size
    distance: str = "cosine"  # "cosine" (Geiping et al.) or "l2" (DLG)
    tv_weight: float = 1e-4  # total-variation prior of the gradient-matching attack
    optimizer: str = "adam"  # "adam" (signed gradients, lr x0.1 at 3/8, 5/8, 7/8 of the steps) or "lbfgs"
    restarts: int = 1  # independent random starts; the best final gradient distance wins
    known_labels: bool = True  # False: labels inferred from the classifier bias gradient (iDLG)
    seed: int = 0  # the dummy images' initialization
    enabled: bool = False  # also --privacy
    images: Count = 10  # one test image per class (first occurrences), up to this many (the paper: one per class)
    batch_size: Count = 1  # images per client update; the APRIL analytic attack needs 1
    # masked-jigsaw gamma of settings (b) / (c) (Table 5 uses MJP with gamma = 0.27)
    ratio: Annotated[float, Field(gt=0, lt=1)] = 0.27
    analytic: bool = True  # APRIL's closed form, for models with a learnable PE

    def attack(self) -> AttackConfig:
        from patchplace.finetune import AttackConfig  # (imports torch)

        return AttackConfig(**{f.name: getattr(self, f.name) for f in fields(AttackConfig)})

    __pydantic_config__ = STRICT
    key: ClassVar[str] = "privacy"

    def validate(self) -> None:
        """The declared checks (:func:`check`), then the attack's (patchplace.finetune's)."""
        from patchplace.finetune import PrivacyError  # (imports torch)

        check(self)
        try:
            self.attack().validate()
        except PrivacyError as exc:
            raise ConfigError(f"privacy: {exc}") from None


@dataclass
class EvalDataSection(DataSection):
    """The splits and their reading, as for training; every split is read unaugmented: these class values stand in
    for training's augmentation fields (not fields here, so not read from a config)."""

    scale: ClassVar[tuple[float, float]] = (1.0, 1.0)
    hflip: ClassVar[float] = 0.0
    auto_augment: ClassVar[str | None] = None
    re_prob: ClassVar[float] = 0.0
    re_mode: ClassVar[str] = "const"
    re_count: ClassVar[int] = 1
    repeated_aug: ClassVar[int] = 1
    grayscale: ClassVar[float] = 0.0
    gaussian_blur: ClassVar[float] = 0.0
    color_jitter: ClassVar[float] = 0.0
    mixup: ClassVar[float] = 0.0
    cutmix: ClassVar[float] = 0.0
    mixup_prob: ClassVar[float] = 1.0
    mixup_switch_prob: ClassVar[float] = 0.5
    noise_split: ClassVar[str | None] = None
    frontend: ClassVar[str | None] = None  # (a speech checkpoint's own: the one it recorded)


@dataclass
class EvalModelSection:
    """The checkpoint evaluated; it brings its architecture (no preset, no overrides)."""

    checkpoint: str | None = None  # required: the checkpoint/ (or best/) directory of a pretrain or finetune run
    # attention kernel: sdpa | math (the materialised softmax); the same numbers either way
    attention: Attention = "sdpa"
    __pydantic_config__ = STRICT
    key: ClassVar[str] = "model"

    def validate(self) -> None:
        ModelSection.validate(self)  # model.attention, as for training


@dataclass
class EvalRunSection:
    """Where the results go, and the seed. Evaluation runs in full precision, without gradient accumulation or
    TensorBoard: the class values below stand in for training's fields of the Accelerator."""

    output: str = "runs/evaluate"  # results.json, report.md and the plots
    seed: Seed = 0  # every RNG (random, numpy, torch) and the data readers start from it
    overwrite: bool = False  # replace the results of an earlier evaluation in run.output (without it: refused)
    mixed_precision: ClassVar[str] = "no"
    grad_accum: ClassVar[int] = 1
    tensorboard: ClassVar[bool] = False
    fsdp: ClassVar[str] = "off"  # the ranks share the feature extraction, each with the whole model
    __pydantic_config__ = STRICT
    key: ClassVar[str] = "run"

    def validate(self) -> None:
        check(self)


@dataclass
class EvaluateConfig:
    eval: EvalSection = field(default_factory=EvalSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    data: EvalDataSection = field(default_factory=EvalDataSection)
    model: EvalModelSection = field(default_factory=EvalModelSection)
    run: EvalRunSection = field(default_factory=EvalRunSection)
    # the training sections these stand for: a training config loads too, the fields evaluation's sections lack are
    # accepted, ignored and named at the end of --help (config.unread_fields)
    shares: ClassVar[dict[str, type]] = {"data": DataSection, "model": ModelSection, "run": RunSection}
    __pydantic_config__ = STRICT

    def validate(self) -> None:
        if not self.model.checkpoint:
            raise ConfigError("model.checkpoint is required: the checkpoint/ directory of a pretrain or finetune run")


def expand_flags(argv: list[str]) -> list[str]:
    """evaluate.py's shorthand flags as the overrides they stand for (``--privacy``: ``privacy.enabled=true``)."""
    if "--privacy" not in argv:
        return argv
    return [a for a in argv if a != "--privacy"] + ["privacy.enabled=true"]
