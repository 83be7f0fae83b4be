"""The objectives' configs, importable without torch (what ``--help``, the study's plan and the benchmark read):
each method's config dataclass (the papers' defaults, their meaning in comments, ``validate()``); the facts of each
method's registration are in :mod:`.declarations`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from patchplace.models import Backbone

class ObjectiveError(ValueError):
    """A bad objective config or batch (one line naming the field and what is expected)."""


@dataclass
class ObjectiveConfig:
    """Base of every objective's config dataclass: the papers' ratios and schedules as defaults, ``validate()`` on
    build. Decoder / predictor widths left ``None`` follow the backbone (``RELATIVE``, filled in by
    :meth:`for_backbone` when the objective is built), so a small backbone gets a small decoder; ``paper()`` gives
    the paper's widths.

    ``validate(named)`` words each field a refusal mentions as ``named("field")``: the bare name by default, a
    caller's key where the config sits inside a larger one (the pipelines' ``"objective.{}".format``)."""

    # width fields that default to the backbone's: field -> "embed_dim" | "half_embed_dim" | "num_heads"
    RELATIVE: ClassVar[dict[str, str]] = {}
    PAPER: ClassVar[dict[str, Any]] = {}  # the paper's (ImageNet) widths

    def validate(self, named: Callable[[str], str] = str) -> ObjectiveConfig:
        """This config, checked: an :class:`ObjectiveError` naming each field it mentions as ``named(field)``."""
        return self

    @classmethod
    def paper(cls, **overrides: Any):
        """The paper's decoder / predictor widths (plus ``overrides``)."""
        return cls(**{**cls.PAPER, **overrides}).validate()

    def for_backbone(self, backbone: Backbone):
        """This config with the widths left ``None`` taken from ``backbone`` (see ``RELATIVE``), validated. Widths
        set explicitly are kept whatever the backbone; where a filled-in one does not fit them (e.g. ``decoder_dim``
        512 with the backbone's 12 heads), the error names what came from the backbone."""
        values = {"embed_dim": backbone.embed_dim, "half_embed_dim": backbone.embed_dim // 2,
                  "num_heads": backbone.config.num_heads}
        filled = {name: values[rule] for name, rule in self.RELATIVE.items() if getattr(self, name) is None}
        if not filled:
            return self
        try:
            return replace(self, **filled).validate()
        except ObjectiveError as exc:
            taken = ", ".join(f"{name}={value}" for name, value in filled.items())
            raise ObjectiveError(f"{exc} ({taken} taken from the backbone because left null: set it explicitly)"
                                 ) from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], named: Callable[[str], str] = str):
        """The config of the fields ``raw``, validated (refusals word fields as ``named(field)``: :meth:`validate`)."""
        known = {f.name for f in fields(cls)}
        unknown = [named(name) for name in sorted(set(raw) - known)]
        if unknown:
            raise ObjectiveError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
        return cls(**raw).validate(named)


def check_ratio(name: str, value: float, *, high_inclusive: bool = False) -> None:
    """A masking ratio in [0, 1) (or [0, 1]); ``name``: the key the refusal names (``named("eta")``)."""
    ok = 0.0 <= value <= 1.0 if high_inclusive else 0.0 <= value < 1.0
    if not ok:
        raise ObjectiveError(f"{name} must be in [0, 1{']' if high_inclusive else ')'}, got {value}")


def check_widths(config: ObjectiveConfig, dim: str, heads: str, *, multiple_of: int = 1,
                 named: Callable[[str], str] = str) -> None:
    """A decoder / predictor width and head count (fields ``dim``, ``heads``, named ``named(dim)`` in a refusal):
    positive where set (``None``: the backbone's, filled in by :meth:`ObjectiveConfig.for_backbone`), the width
    divisible by the heads (and by ``multiple_of``)."""
    width, count = getattr(config, dim), getattr(config, heads)
    for name, value in ((dim, width), (heads, count)):
        if value is not None:
            check_positive(named(name), value)
    if width is not None and count is not None and width % count:
        raise ObjectiveError(f"{named(dim)} {width} must be divisible by {named(heads)} {count}")
    if width is not None and width % multiple_of:
        raise ObjectiveError(f"{named(dim)} must be divisible by {multiple_of} (2-D sin-cos PE), got {width}")


def check_positive(name: str, value: float) -> None:
    """``value`` > 0; ``name``: the key the refusal names."""
    if not value > 0:
        raise ObjectiveError(f"{name} must be > 0, got {value}")



COUNT_RULES = ("int", "round")  # MJP's target count: int(gamma N) (official) | round(gamma N)


@dataclass
class SupervisedConfig(ObjectiveConfig):
    label_smoothing: float = 0.1  # of the one-hot targets

    def validate(self, named: Callable[[str], str] = str) -> SupervisedConfig:
        check_ratio(named("label_smoothing"), self.label_smoothing)
        return self


@dataclass
class MP3Config(ObjectiveConfig):
    """``eta``: masking ratio (paper: 0.5 on CIFAR-100, 0.75 on ImageNet, 0 for speech);
    ``anchor_ratio``: fraction of tokens given their true PE and excluded from the loss (speech: 0.05)."""

    eta: float = 0.75
    anchor_ratio: float = 0.0

    def validate(self, named: Callable[[str], str] = str) -> MP3Config:
        check_ratio(named("eta"), self.eta)
        check_ratio(named("anchor_ratio"), self.anchor_ratio)
        return self

    @classmethod
    def speech(cls) -> MP3Config:
        """MP3 §4.3 speech setting: full attention (eta = 0) and 5% anchors."""
        return cls(eta=0.0, anchor_ratio=0.05)


@dataclass
class MAEConfig(ObjectiveConfig):
    """MAE defaults: mask 0.75, 8 decoder blocks, normalized-pixel targets; the decoder as wide as the backbone
    with its head count (``MAEConfig.paper()``: 512 wide x 16 heads, the paper's ImageNet decoder)."""

    RELATIVE: ClassVar[dict[str, str]] = {"decoder_dim": "embed_dim", "decoder_heads": "num_heads"}
    PAPER: ClassVar[dict[str, Any]] = {"decoder_dim": 512, "decoder_depth": 8, "decoder_heads": 16}

    mask_ratio: float = 0.75  # fraction of patches masked
    decoder_dim: int | None = None  # decoder width (None: the backbone's; paper(): 512)
    decoder_depth: int = 8  # decoder blocks
    decoder_heads: int | None = None  # decoder heads (None: the backbone's; paper(): 16)
    norm_pix_loss: bool = True  # per-patch normalized pixel targets

    def validate(self, named: Callable[[str], str] = str) -> MAEConfig:
        check_ratio(named("mask_ratio"), self.mask_ratio)
        check_positive(named("decoder_depth"), self.decoder_depth)
        check_widths(self, "decoder_dim", "decoder_heads", named=named)
        return self


@dataclass
class DropPosConfig(ObjectiveConfig):
    """DropPos hyper-parameters; defaults are the paper's (§4 "Pre-training", Tables 1-4 defaults).

    ``mask_ratio`` gamma (Eq. 1), ``pos_mask_ratio`` gamma_pos (Eq. 2); a 2-block decoder without PE, as wide as
    the backbone (``DropPosConfig.paper()``: 512 wide, 16 heads);
    sigma decays linearly ``sigma_start`` -> ``sigma_end`` (Eq. 7); ``tau`` is the attentive-reconstruction
    temperature (Eq. 9) — ``float("inf")`` switches attentive reconstruction off (Table 4, "tau = inf").
    """

    RELATIVE: ClassVar[dict[str, str]] = {"decoder_dim": "embed_dim", "decoder_heads": "num_heads"}
    PAPER: ClassVar[dict[str, Any]] = {"decoder_dim": 512, "decoder_depth": 2, "decoder_heads": 16}

    mask_ratio: float = 0.75  # gamma: patches dropped from the encoder (Eq. 1)
    pos_mask_ratio: float = 0.75  # gamma_pos: share of the visible patches whose PE is dropped (Eq. 2); the rest anchor
    decoder_dim: int | None = None  # position decoder width, no PE (None: the backbone's; paper(): 512)
    decoder_depth: int = 2  # position decoder blocks
    decoder_heads: int | None = None  # position decoder heads (None: the backbone's; paper(): 16)
    sigma_start: float = 1.0  # position-smoothing sigma at the start, decayed linearly (Eq. 7)
    sigma_end: float = 0.0  # ... and at the end
    tau: float = 0.1  # attentive-reconstruction temperature (Eq. 9); .inf switches it off (Table 4)

    def validate(self, named: Callable[[str], str] = str) -> DropPosConfig:
        check_ratio(named("mask_ratio"), self.mask_ratio)
        check_ratio(named("pos_mask_ratio"), self.pos_mask_ratio)
        check_positive(named("decoder_depth"), self.decoder_depth)
        check_widths(self, "decoder_dim", "decoder_heads", named=named)
        for name in ("sigma_start", "sigma_end"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ObjectiveError(f"{named(name)} must be a finite number >= 0, got {value}")
        check_positive(named("tau"), self.tau)  # inf is allowed (no attentive reconstruction); nan is not
        return self


COVARIANCES = ("learned", "fixed")


NOISE_ON = ("masked", "context", "both")


@dataclass
class IJEPAConfig(ObjectiveConfig):
    """I-JEPA defaults (a 12-block predictor half as wide as the backbone with its head count; 4 target blocks of
    scale 0.15-0.2 and aspect 0.75-1.5; a context block of scale 0.85-1.0; EMA momentum 0.996 -> 1.0) and StoP
    (``stop=True``, sigma = 0.25, noise on masked tokens, learned covariance).

    ``paper()``: the authors' released predictors (the papers state no predictor size), 384 wide with the encoder's
    head count (both codes build it with ``num_heads=encoder.num_heads``): I-JEPA 12 blocks (``configs/
    in1k_vith14_ep300.yaml``: ``pred_depth: 12``, ``pred_emb_dim: 384``, ViT-H/14), StoP (``paper(stop=True)``) 6
    blocks (StoP's ``configs/pretrain/vit-b16.yaml``: ``pred_depth: 6``, ``emb_dim: 384``, ViT-B/16)."""

    RELATIVE: ClassVar[dict[str, str]] = {"predictor_dim": "half_embed_dim", "predictor_heads": "num_heads"}
    PAPER: ClassVar[dict[str, Any]] = {"predictor_dim": 384, "predictor_depth": 12, "predictor_heads": None}
    STOP_PAPER: ClassVar[dict[str, Any]] = {"predictor_dim": 384, "predictor_depth": 6, "predictor_heads": None}

    predictor_dim: int | None = None  # predictor width (None: half the backbone's; paper(): 384)
    predictor_depth: int = 12  # predictor blocks (paper(): 12 for I-JEPA ViT-H/14, 6 for StoP ViT-B/16)
    predictor_heads: int | None = None  # predictor heads (None: the backbone's, as both official codes)
    num_targets: int = 4  # target blocks per image
    target_scale: tuple[float, float] = (0.15, 0.2)  # target block area, fraction of the image
    target_aspect: tuple[float, float] = (0.75, 1.5)  # target block aspect ratio
    context_scale: tuple[float, float] = (0.85, 1.0)  # context block area (targets removed from it)
    min_keep: int = 4  # a context must keep more than this many patches (the official collator's retry rule)
    context_keep: int | None = None  # context patches per sample, fixed for the run (None: the official expected
    # batch minimum at batch 128, calibrated once per grid; see docs/methods/stop.md)
    ema_start: float = 0.996  # target-encoder EMA momentum at the start, linear to ema_end
    ema_end: float = 1.0  # ... at the end
    stop: bool = False  # StoP: stochastic positions for the masked tokens
    sigma: float = 0.25  # StoP noise scale
    noise_on: str = "masked"  # StoP: which tokens get the noise: masked | context | both
    covariance: str = "learned"  # StoP noise covariance: learned | fixed

    @classmethod
    def paper(cls, **overrides: Any) -> IJEPAConfig:
        """The authors' predictor (class docstring): StoP's ViT-B/16 one with ``stop=True``, else I-JEPA's ViT-H/14."""
        widths = cls.STOP_PAPER if overrides.get("stop") else cls.PAPER
        return cls(**{**widths, **overrides}).validate()

    def validate(self, named: Callable[[str], str] = str) -> IJEPAConfig:
        for name in ("predictor_depth", "num_targets", "min_keep"):
            check_positive(named(name), getattr(self, name))
        if self.context_keep is not None:
            check_positive(named("context_keep"), self.context_keep)
        check_widths(self, "predictor_dim", "predictor_heads", multiple_of=4, named=named)
        for name in ("target_scale", "context_scale"):
            low, high = getattr(self, name)
            if not 0 < low <= high <= 1:
                raise ObjectiveError(f"{named(name)} must satisfy 0 < low <= high <= 1, got {(low, high)}")
        if not 0 < self.target_aspect[0] <= self.target_aspect[1]:
            raise ObjectiveError(f"{named('target_aspect')} must satisfy 0 < low <= high, got {self.target_aspect}")
        check_ratio(named("ema_start"), self.ema_start, high_inclusive=True)
        check_ratio(named("ema_end"), self.ema_end, high_inclusive=True)
        if self.sigma < 0:
            raise ObjectiveError(f"{named('sigma')} (a standard deviation) must be >= 0, got {self.sigma}")
        if self.noise_on not in NOISE_ON or self.covariance not in COVARIANCES:
            raise ObjectiveError(f"{named('noise_on')} must be one of {NOISE_ON} and {named('covariance')} one of "
                                 f"{COVARIANCES}, got {self.noise_on!r}, {self.covariance!r}")
        return self


DAL_SCHEDULES = ("constant", "official")


DAL_KINDS = ("pca", "linear", "mlp")


@dataclass
class MJPConfig(ObjectiveConfig):
    """MJP hyper-parameters; defaults are the paper's ImageNet recipe.

    * ``ratio`` gamma, the fraction of patches the block-wise generator selects (Alg. 1 line 3). 0.03 is the model of
      Table 1 (DeiT-S + MJP: 80.5 top-1, consistency 82.9), i.e. the best top-1 of the gamma sweep in Table 3
      (0.03: 80.5, 0.09: 80.3, 0.15: 80.4, 0.21: 80.2, 0.27: 80.3) and the "trained with gamma = 0.03" model of
      Fig. 3 (a, b). Larger gamma trades a little accuracy for consistency (Table 3: 82.9 -> 93.1 at 0.27). NB: on
      small grids 0.03 selects fewer than 2 patches (e.g. int(0.03 * 64) = 1), so :class:`MJP` rejects it there.
    * ``count_rule`` ``"int"``: the generator aims for int(gamma N) patches, as the official code
      (yhlleo/MJP ``data/masking_generator.py``, ``MaskingGenerator._num_patches_decaying``:
      ``int(self.num_patches * cur_ratio)``); ``"round"`` aims for round(gamma N), one patch more where the
      fraction is >= .5 (e.g. 2 instead of 1 at 0.03 on 8 x 8, so that small grids can train at gamma 0.03).
    * ``min_block`` 8 patches and ``min_aspect`` 0.3 (aspect in [0.3, 1/0.3]): BEiT's generator as the official
      training uses it (``data/masking_generator.py``).
    * ``apply_prob`` 0.5: the jigsaw is applied to a random half of the batches (official ``AUG.JIGSAW = 0.5``), and
      only after ``warmup_fraction`` = 20 / 300 of training (official: ``epoch >= WARMUP_EPOCHS`` with 20 warm-up
      epochs of 300, supp. Table 7).
    * ``dal``: the DAL map g of Eq. 1 — ``pca`` (non-parametric), ``linear`` (LN) or ``mlp`` (NLN, 3 layers; §5.3
      / Table 4: "a 3-layers MLP" is the best variant, 80.5 top-1). ``dal_weight`` lambda = 0.01 (§4.2, "for all
      experiments"); ``dal_schedule="official"`` is the official code's warm-up + cosine 0.01 -> 0.005 instead
      (see :meth:`MJP.dal_weight_at`), per epoch as the official code: training ``progress`` is cut into
      ``schedule_epochs`` (300, the official recipe) equal epochs of the schedule.
    * ``label_smoothing`` 0.1: the DeiT recipe the paper follows (supp. Table 7; official ``LABEL_SMOOTHING``).
    * ``decay_pos_embed``: weight decay on the learned PE table and ``E_unk`` (the class token stays exempt). The
      official code decays them: its PE is one ``nn.Embedding`` of the patch, class-token and unknown rows
      (``models/vit_timm.py``), whose ``pos_embed.weight`` its ``no_weight_decay()`` set ``{'pos_embed',
      'cls_token', 'dist_token'}`` does not name (``optimizer.py`` ``set_weight_decay`` matches names exactly);
      ``train.sh`` passes ``--decay-posemb``. False (the default) keeps the project's rule: no PE is decayed.
    """

    ratio: float = 0.03  # gamma: fraction of patches jigsawed (Alg. 1)
    count_rule: str = "int"  # target count: int(gamma N) (official) | round(gamma N)
    min_block: int = 8  # smallest block of the block-wise generator (patches)
    min_aspect: float = 0.3  # block aspect in [min_aspect, 1 / min_aspect]
    apply_prob: float = 0.5  # fraction of batches jigsawed
    warmup_fraction: float = 20 / 300  # no jigsaw before this fraction of training
    dal: str = "mlp"  # DAL map g (Eq. 1): mlp | linear | pca
    dal_weight: float = 0.01  # lambda of the DAL loss
    dal_schedule: str = "constant"  # constant | official (warm-up + cosine 0.01 -> 0.005)
    schedule_epochs: int = 300  # epochs the official DAL schedule is cut into
    label_smoothing: float = 0.1  # DeiT recipe
    decay_pos_embed: bool = False  # weight decay on the PE table and E_unk (official code: decayed)

    def validate(self, named: Callable[[str], str] = str) -> MJPConfig:
        check_ratio(named("ratio"), self.ratio)
        if self.count_rule not in COUNT_RULES:
            raise ObjectiveError(f"{named('count_rule')} must be one of {COUNT_RULES}, got {self.count_rule!r}")
        if isinstance(self.min_block, bool) or not isinstance(self.min_block, int) or self.min_block < 1:
            raise ObjectiveError(f"{named('min_block')} must be an integer >= 1 (patches), got {self.min_block!r}")
        if not 0.0 < self.min_aspect <= 1.0:
            aspect = named("min_aspect")
            raise ObjectiveError(f"{aspect} must be in (0, 1] (aspects span [{aspect}, 1/{aspect}]), got "
                                 f"{self.min_aspect}")
        check_ratio(named("apply_prob"), self.apply_prob, high_inclusive=True)
        check_ratio(named("warmup_fraction"), self.warmup_fraction)
        if self.dal not in DAL_KINDS:
            raise ObjectiveError(f"{named('dal')} must be one of {DAL_KINDS}, got {self.dal!r}")
        if not (math.isfinite(self.dal_weight) and self.dal_weight >= 0):
            raise ObjectiveError(f"{named('dal_weight')} (lambda) must be a finite number >= 0, got {self.dal_weight}")
        if self.dal_schedule not in DAL_SCHEDULES:
            raise ObjectiveError(f"{named('dal_schedule')} must be one of {DAL_SCHEDULES}, got {self.dal_schedule!r}")
        if isinstance(self.schedule_epochs, bool) or not isinstance(self.schedule_epochs, int) or not (
                round(self.warmup_fraction * self.schedule_epochs) < self.schedule_epochs):
            epochs = named("schedule_epochs")
            raise ObjectiveError(f"{epochs} must be an integer with round({named('warmup_fraction')} * {epochs}) "
                                 f"< {epochs}, got {self.schedule_epochs!r}")
        check_ratio(named("label_smoothing"), self.label_smoothing)
        if not isinstance(self.decay_pos_embed, bool):
            raise ObjectiveError(f"{named('decay_pos_embed')} must be true or false, got {self.decay_pos_embed!r}")
        return self


SEGMENT_TYPES = ("blob", "square", "raster", "patch_random")


@dataclass
class RandSACConfig(ObjectiveConfig):
    """RandSAC defaults.

    ``segments``: ``blob`` (paper default, §3.2 "we choose blobs for the remainder"), ``square``, or the segment-free
    ablations ``raster`` / ``patch_random`` (one token per segment, Tables 1-3).
    ``num_segments``: K blobs (11, the default of the CIFAR-10 / ImageNet-100 / ImageNet-1K runs, Table 7, §5).
    ``square_size``: M for square segments (2, the best of Table 4).
    ``hierarchy``: partition counts per level above the segments, strictly decreasing: ``(5,)`` is "11 -> 5", the
    CIFAR-10 / ImageNet-100 default (App. A.1, §5 low-data); ImageNet-1K uses ``(7, 3)`` ("11 -> 7 -> 3", §5);
    ``()`` is flat random serialization.
    Decoder: 4 layers of width 512 with 16 heads — the ImageNet-1K model of §5 / Table 10 (CIFAR-10 used 3 layers,
    ImageNet-100 4 layers, each as wide as the encoder, App. A.1).
    ``skip_connections``: trainable skip connections (§4.2, on in every final model, Table 8).
    ``norm_pix_loss``: per-patch normalized pixel targets (Tables 7, 13, 14).
    """

    RELATIVE: ClassVar[dict[str, str]] = {"decoder_dim": "embed_dim", "decoder_heads": "num_heads"}
    PAPER: ClassVar[dict[str, Any]] = {"decoder_dim": 512, "decoder_depth": 4, "decoder_heads": 16}

    segments: str = "blob"  # blob | square | raster | patch_random
    num_segments: int = 11  # K blobs (Table 7)
    square_size: int = 2  # M for square segments (Table 4)
    hierarchy: tuple[int, ...] = (5,)  # partitions per level above the segments, e.g. (5,) = 11 -> 5; () flat
    decoder_dim: int | None = None  # decoder width (None: the backbone's; paper(): 512)
    decoder_depth: int = 4  # decoder blocks
    decoder_heads: int | None = None  # decoder heads (None: the backbone's; paper(): 16)
    decoder_mlp_ratio: float = 4.0  # decoder MLP width / decoder_dim
    skip_connections: bool = True  # trainable encoder -> decoder skips (§4.2)
    norm_pix_loss: bool = True  # per-patch normalized pixel targets

    def validate(self, named: Callable[[str], str] = str) -> RandSACConfig:
        if self.segments not in SEGMENT_TYPES:
            raise ObjectiveError(f"{named('segments')} must be one of {SEGMENT_TYPES}, got {self.segments!r}")
        self.hierarchy = tuple(self.hierarchy)  # from JSON / YAML lists
        if self.segments == "blob" and self.num_segments < 2:
            raise ObjectiveError(f"{named('num_segments')} must be >= 2 (one segment leaves nothing to predict), got "
                                 f"{self.num_segments}")
        check_positive(named("square_size"), self.square_size)
        if self.hierarchy and self.segments in ("raster", "patch_random"):
            raise ObjectiveError(f"{named('hierarchy')} must be () for {named('segments')}={self.segments!r} (one "
                                 f"token per segment), got {self.hierarchy}")
        top = self.num_segments if self.segments == "blob" else None
        for parts in self.hierarchy:
            if not isinstance(parts, int) or parts < 1 or (top is not None and parts >= top):
                raise ObjectiveError(f"{named('hierarchy')} must be strictly decreasing partition counts >= 1 below "
                                     f"{named('num_segments')}={self.num_segments} (e.g. (5,) for 11 -> 5), got "
                                     f"{self.hierarchy}")
            top = parts
        for name in ("decoder_depth", "decoder_mlp_ratio"):
            check_positive(named(name), getattr(self, name))
        check_widths(self, "decoder_dim", "decoder_heads", multiple_of=4, named=named)
        return self
