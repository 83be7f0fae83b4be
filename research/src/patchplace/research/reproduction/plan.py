"""The study's plan: its budget knobs (:class:`StudyConfig`), the groups, and one :class:`Run` per table row (how
its backbone is trained, how its classifier is obtained)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from patchplace.objectives.declarations import known_methods  # the registrations' facts, without importing torch
from patchplace.pipelines.config import ConfigError

GROUPS = ("curves", "main", "mp3_pe", "mp3_eta", "droppos", "mjp", "randsac", "speech")
CONTROLS = "controls"  # in ``only``: the probe controls (main's, runs/controls), beside or instead of rows


@dataclass
class StudyConfig:
    """Budget knobs of the study (one place)."""

    preset: str = "vit_cpu_narrow"  # the one ViT of every image run
    pretrain_epochs: float = 0.25  # image pretraining epochs per method
    finetune_epochs: float = 0.25  # supervised / MJP train pretrain_epochs + finetune_epochs from scratch
    seeds: tuple[int, ...] = (0,)  # main table
    # validation: this many class-balanced images held out of the train split (data.holdout); every training stage
    # validates on them (training-time evaluation, early stopping), the test split is read once per final number;
    # label subsets and probe sets are drawn from the rest. 0: validate on the test split (no held-out split)
    holdout: int = 5000
    # learning curves ("does it learn here?"): one pretraining per curve row (seed curve_seed) to max(curve_epochs)
    # epochs, its snapshots after each of curve_epochs (0: the random init) probed with 1% of the labels on
    # curve_val_samples validation images, beside the raw-pixel and random-init controls. () = no curves
    curve_epochs: tuple[float, ...] = ()
    # a curve per main row (default: every pretrained main row)
    curve_rows: tuple[str, ...] = field(default_factory=lambda: pretrained_main_rows())
    curve_seed: int = 0  # the seed of the learning-curve pretrainings
    curve_val_samples: int = 5000  # validation images the curve probes are scored on
    controls: bool = True  # raw-pixel and random-init (per seed) probe controls on the study's sets and images
    label_finetune: bool = True  # fine-tune the pretrained rows on each label fraction (false: linear probes only)
    # label-fraction training (supervised from scratch, fine-tunes): evaluate on the validation split every
    # label_eval_epochs epochs over the subset and stop after label_patience evaluations without a better top-1
    # (label_finetune_epochs is then the cap); the best checkpoint is tested. 0: fixed epochs, the last one tested
    label_patience: int = 0
    label_eval_epochs: float = 1.0  # epochs over the subset between validation evaluations
    ort: bool = True  # ONNX export + ONNX Runtime evaluation (top-1, consistency, corruptions) of the main rows
    # speech (MP3 §4.3): fine-tuning gets as many updates as the supervised run, early stopping on validation;
    # speech_null: the same fine-tune from a 1-step "pretraining" (separates "pretraining hurts" from "the
    # fine-tuning path is broken")
    speech_null: bool = True
    speech_patience: int = 0  # evaluations (every speech_eval_epochs) without a better validation top-1; 0: off
    speech_eval_epochs: float = 5.0  # speech epochs between validation evaluations
    # main rows fine-tuned with all labels on every seed (the rows a full-label claim reads); the other main rows
    # only on the first seed (their pretraining, probes and label-efficiency runs still take every seed).
    # () = every main row on every seed
    full_label_rows: tuple[str, ...] = ()
    # with full_label_rows: whether the other main rows are fine-tuned on the first seed (false: probed only, no
    # fine-tune / evaluation at all: the rows no claim reads cost nothing but their pretraining and probes)
    first_seed_finetunes: bool = True
    # label efficiency (the SSL protocol): each pretrained main method fine-tuned and linearly probed on these
    # class-balanced fractions of the train labels, beside the supervised ViT trained from scratch on the same subset
    label_fractions: tuple[float, ...] = (0.01, 0.1)
    label_finetune_epochs: tuple[float, ...] = (20.0, 3.0)  # epochs over each subset (same length as the fractions)
    label_subset_seed: int = 0  # which balanced subsets (the same for every method and seed)
    label_batch_size: int | None = None  # batch of the label-efficiency stages (None: batch_size); smaller = more steps
    ablation_seeds: tuple[int, ...] = (0,)  # seeds of the ablation groups
    # rows that run close_seeds instead of their group's seeds (e.g. 5 where a claim is close to decidable); a main
    # row's extra seeds are pretrained, probed and gated only (full-label fine-tunes and label subsets stay on seeds)
    close_rows: tuple[str, ...] = ()
    close_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # the seeds of the close_rows
    # pretraining epochs of named rows instead of pretrain_epochs: {row: epochs}; rows compared by a claim get the
    # same budget (e.g. StoP and I-JEPA)
    row_pretrain_epochs: dict[str, Any] = field(default_factory=dict)
    # the learned gate (claims.gate): every pretrained row's frozen features, linear probe on the all-label probe
    # set scored on gate_val_samples validation images, beside the random init of its architecture and feature (same
    # seed); a row is learned where a one-sided Welch test over >= 3 seeds beats that control at alpha 0.05
    gate: bool = True
    # run no (row, seed) that results/<name>.json measured whole at this budget (another machine, a cleaned
    # runs/): its numbers are merged as they are
    reuse_results: bool = False
    gate_val_samples: int = 5000  # validation images the gate's probes are scored on
    # budget ladder: a row pretrained longer than a budget here keeps a snapshot at it, gated and probed on test too;
    # a claim reads the smallest budget at which every row it compares passes the gate
    gate_budgets: tuple[float, ...] = ()
    groups: tuple[str, ...] = GROUPS  # in priority order: each process runs its groups in this order
    # run names to restrict the groups to (e.g. add seeds to some rows), "controls" for main's probe controls
    # (measured only when only is () or names them); () = all
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()  # run names left out of their groups (e.g. rows no claim reads at this budget)
    only_seeds: tuple[int, ...] = ()  # seeds this process runs (study.py --jobs gives each process its own); () = all
    # study.py's units (--jobs): one per (row, seed) instead of one per (group, seed): a row that fine-tunes
    # another's pretraining (mp3_pe's MP3 fine-tunes) with that row, the controls a unit of their own (the first
    # main seed, only=[controls]), a learning curve per row as ever; finer units keep every --jobs process busy
    unit_per_row: bool = False
    probe_only: tuple[str, ...] = ()  # ablation groups evaluated by probes only (no fine-tuning; not main)
    batch_size: int = 128  # image stages, per process
    num_workers: int = 1  # data.num_workers of every stage (decoding shards; streaming workers)
    threads: int = 0  # torch threads per study process (0: torch's default)
    # the training stages' run.mixed_precision: auto (resolved once at start on this machine, engine/hardware.py:
    # bf16 only where the device has bf16 units and bf16 training passed its equivalence test) | no | bf16
    precision: str = "auto"
    finetune_overrides: tuple[str, ...] = ("finetune.mixup=0.0", "finetune.cutmix=0.0")  # on the recipe
    # recipe choices this config carries that were not confirmed on the validation split: listed in the report
    unverified_recipe: tuple[str, ...] = ()
    probe_train_samples: int = 2000  # train images of the (all-label) linear / kNN / position probes
    probe_val_samples: int = 2000  # test images the probes are scored on
    probe_epochs: int = 100  # epochs of each linear probe
    probe_extras: bool = True  # the kNN-per-layer and position probes too (the linear probes always run)
    curve_samples: int = 1000  # test images for the consistency / eta / DropPos-grid curves
    ort_consistency_samples: int = 1000  # test images of the ONNX Runtime consistency check
    robustness_samples: int = 200  # test images x 13 corruptions x 5 severities (ONNX Runtime)
    speech_pretrain_epochs: float = 20.0  # MP3 speech pretraining epochs
    speech_finetune_epochs: float = 30.0  # speech fine-tuning epochs (supervised: as many, from scratch; §4.3)
    speech_seeds: tuple[int, ...] = (0, 1, 2)  # seeds of the speech rows
    privacy_images: int = 10  # MJP Table 5 gradient inversion: one test image per class (0: skip)
    privacy_steps: int = 200  # gradient-matching attack steps per client update (APRIL's analytic attack: exact)
    test_samples: int | None = None  # cap on test images for top-1 (None: all 10,000)
    fashion_mnist: str = "shards/fashion_mnist"  # image shards: train/ and test/
    spoken_keywords: str = "shards/spoken_keywords"  # speech shards: train/, test/, background_noise/
    overrides: tuple[str, ...] = ()  # section.field=value for every image training / evaluation stage
    speech_overrides: tuple[str, ...] = ()  # section.field=value for every speech stage
    runs: str = "runs/study"  # run directories: <runs>/seed<k>/<run>/<stage>/
    results: str = "results"  # where <name>.json / .md / PNGs go
    name: str = "study"  # results files: <results>/<name>.json, <name>.md, <name>_*.png
    compare_with: str | None = None  # an earlier study.json: its claims, judged by the same rules, beside these
    # the pre-registered protocol (e.g. research/protocols/study_v5.yaml): its claims, regimes, seeds and epochs
    # decide the report, rows record its sha256 and are refused when trained before its commit; None: v4's rules
    protocol: str | None = None
    patch_size: int | None = None  # patch side of every image row's backbone (None: the preset's, 4 px)
    # run directories name their pretraining epochs (<row>@e<epochs>): a doubled budget never meets the stages of
    # the shorter one (the protocol's doubling rule)
    epochs_in_path: bool = False
    # the MP3 eta curve / DropPos grid of each position row on the validation split too (<row>/position_val): what
    # a protocol's regime and doubling rule read
    validation_positions: bool = False
    # image classifiers trained from scratch (supervised, MJP): evaluate on validation every classifier_eval_epochs
    # and stop after classifier_patience evaluations without a better top-1 (the best checkpoint tested); 0: off
    classifier_patience: int = 0
    classifier_eval_epochs: float = 1.0  # epochs between the classifiers' validation evaluations
    classifier_epochs: float = 0.0  # their epochs (with patience: the cap); 0: pretrain_epochs + finetune_epochs

    def validate(self) -> None:
        unknown = sorted(set(self.groups) - set(GROUPS))
        if unknown:
            raise ConfigError(f"groups: unknown {unknown}; known: {list(GROUPS)}")
        if min(self.pretrain_epochs, self.finetune_epochs, self.speech_pretrain_epochs,
               self.speech_finetune_epochs) <= 0:
            raise ConfigError("study epochs must be > 0")
        if not set(self.probe_only) <= set(GROUPS) - {"main", "mp3_pe", "mjp", "speech"}:
            raise ConfigError(f"probe_only: only pretraining ablation groups (mp3_eta, droppos, randsac), got "
                              f"{list(self.probe_only)}")
        if not self.seeds or not self.ablation_seeds or not self.speech_seeds:
            raise ConfigError("seeds, ablation_seeds and speech_seeds need at least one seed each")
        if self.precision not in ("auto", "no", "bf16"):
            raise ConfigError(f"precision must be auto, no or bf16, got {self.precision!r}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        for knob, names in (("only", self.only), ("skip", self.skip)):
            unknown = sorted(set(names) - {r.name for r in RUNS} - ({CONTROLS} if knob == "only" else set()))
            if unknown:
                raise ConfigError(f"{knob}: unknown run(s) {unknown}; known: {[r.name for r in RUNS]}"
                                  + (f" and {CONTROLS!r}" if knob == "only" else ""))
        if set(self.skip) & {r.name for r in RUNS if r.group == "main"}:
            raise ConfigError(f"skip: main rows are the study's table; drop their groups or seeds instead, got "
                              f"{sorted(self.skip)}")
        if len(self.label_fractions) != len(self.label_finetune_epochs):
            raise ConfigError(f"label_finetune_epochs needs one entry per label fraction: {list(self.label_fractions)} "
                              f"vs {list(self.label_finetune_epochs)}")
        if any(not 0 < f < 1 for f in self.label_fractions) or any(e <= 0 for e in self.label_finetune_epochs):
            raise ConfigError("label_fractions must be in (0, 1) and label_finetune_epochs > 0")
        unknown = sorted(set(self.full_label_rows) - {r.name for r in RUNS if r.group == "main"})
        if unknown:
            raise ConfigError(f"full_label_rows: {unknown} are not main rows; main: "
                              f"{[r.name for r in RUNS if r.group == 'main']}")
        unknown = sorted(set(self.curve_rows) - {r.name for r in RUNS if r.group == "main" and r.config
                                                   and not r.classifier_only})
        if unknown:
            raise ConfigError(f"curve_rows: {unknown} are not pretrained main rows")
        if any(e < 0 for e in self.curve_epochs) or self.label_eval_epochs <= 0 or self.speech_eval_epochs <= 0:
            raise ConfigError("curve_epochs must be >= 0, label_eval_epochs / speech_eval_epochs > 0")
        if self.label_patience < 0 or self.speech_patience < 0 or self.holdout < 0:
            raise ConfigError("label_patience, speech_patience and holdout must be >= 0")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name must be a plain file stem (e.g. study_gpu), got {self.name!r}")
        rows = {r.name for r in RUNS}
        unknown = sorted((set(self.close_rows) | set(self.row_pretrain_epochs)) - rows)
        if unknown:
            raise ConfigError(f"close_rows / row_pretrain_epochs: unknown run(s) {unknown}; known: {sorted(rows)}")
        if self.close_rows and not self.close_seeds:
            raise ConfigError("close_seeds needs at least one seed")
        for name, epochs in self.row_pretrain_epochs.items():
            if not isinstance(epochs, int | float) or epochs <= 0:
                raise ConfigError(f"row_pretrain_epochs.{name}: epochs > 0, got {epochs!r}")
        if any(b <= 0 for b in self.gate_budgets) or self.gate_val_samples < 1:
            raise ConfigError("gate_budgets must be > 0 and gate_val_samples >= 1")
        if self.privacy_images < 0 or self.privacy_steps < 1:
            raise ConfigError("privacy_images must be >= 0 and privacy_steps >= 1")
        if self.patch_size is not None and (self.patch_size < 1 or 32 % self.patch_size):
            raise ConfigError(f"patch_size must divide the 32 px images, got {self.patch_size}")
        if self.classifier_patience < 0 or self.classifier_eval_epochs <= 0 or self.classifier_epochs < 0:
            raise ConfigError("classifier_patience and classifier_epochs must be >= 0, classifier_eval_epochs > 0")


@dataclass(frozen=True)
class Run:
    """One row of the study: how its backbone is trained and how its classifier is obtained."""

    name: str
    group: str
    label: str
    config: str | None  # pretraining config (pipelines/configs/<config>.yaml); None: supervised from scratch
    objective: tuple[str, ...] = ()  # objective.field=value overrides
    finetune_pe: str | None = "keep"  # PE for fine-tuning ("keep": the checkpoint's); None: trained as a classifier
    pretrain_from: str | None = None  # fine-tune another run's pretrained backbone
    scratch_pe: str = "learned"  # supervised from scratch: its PE
    ort: bool = False  # ONNX export + ONNX Runtime evaluation (main table)
    privacy: bool = False  # gradient-inversion attack on its classifier (MJP Table 5)
    speech: bool = False
    label_efficiency: bool = False  # also fine-tuned (or trained from scratch) and probed on label fractions

    @property
    def classifier_only(self) -> bool:
        return self.finetune_pe is None


def main_row(method: str) -> Run:
    """The main-table row of a registered method, from its registration: its name (display), its Fashion-MNIST
    pretraining config, fine-tuned with the checkpoint's PE (a learned one when it pretrains without any: MP3
    Table 3's main row) and on the label fractions, or, when it trains through a classifier head (MJP: a supervised
    recipe, not a pretraining), that classifier as its row, without label-efficiency rows."""
    spec = known_methods()[method]
    finetune_pe = None if spec.needs_head else "learned" if spec.pos_embed == "none" else "keep"
    return Run(method, "main", spec.display, f"{method}_fashion_mnist", finetune_pe=finetune_pe, ort=True,
               label_efficiency=not spec.needs_head)


def pretrained_main_rows() -> tuple[str, ...]:
    """The main rows whose backbone a pretraining trained (the default learning curves)."""
    return tuple(r.name for r in RUNS if r.group == "main" and r.config and not r.classifier_only)


RUNS: tuple[Run, ...] = (
    # main table: same backbone, same data, same total epochs; the supervised baseline trains from scratch
    Run("supervised", "main", known_methods()["supervised"].display, None, finetune_pe=None, ort=True, privacy=True,
        label_efficiency=True),
    *map(main_row, ("mp3", "droppos", "mae", "ijepa", "stop", "randsac", "mjp")),
    # MP3 Table 3: fine-tuning PE of the MP3 backbone, and the supervised baseline with the same three PEs
    Run("mp3_ft_none", "mp3_pe", "MP3, no PE", "mp3_fashion_mnist", finetune_pe="none", pretrain_from="mp3"),
    Run("supervised_nope", "mp3_pe", "supervised, no PE", None, finetune_pe=None, scratch_pe="none",
        privacy=True),
    Run("mp3_ft_relbias2d", "mp3_pe", "MP3, 2D relative", "mp3_fashion_mnist", finetune_pe="relbias2d",
        pretrain_from="mp3"),
    Run("supervised_relbias2d", "mp3_pe", "supervised, 2D relative", None, finetune_pe=None, scratch_pe="relbias2d"),
    # MP3 Figs. 3 and 6: masking ratio eta of pretraining (0.5 is the main run)
    Run("mp3_eta0.75", "mp3_eta", "MP3 eta 0.75", "mp3_fashion_mnist", ("objective.eta=0.75",),
        finetune_pe="learned"),
    Run("mp3_eta0", "mp3_eta", "MP3 eta 0", "mp3_fashion_mnist", ("objective.eta=0.0",), finetune_pe="learned"),
    # DropPos Tables 1, 3, 4 (gamma 0.75, sigma 1 -> 0, tau 0.1 is the main run)
    Run("droppos_gamma0.5", "droppos", "DropPos gamma 0.5", "droppos_fashion_mnist", ("objective.mask_ratio=0.5",)),
    Run("droppos_gamma0.9", "droppos", "DropPos gamma 0.9", "droppos_fashion_mnist", ("objective.mask_ratio=0.9",)),
    Run("droppos_sigma0", "droppos", "DropPos sigma 0", "droppos_fashion_mnist",
        ("objective.sigma_start=0.0", "objective.sigma_end=0.0")),
    Run("droppos_tau_inf", "droppos", "DropPos tau inf", "droppos_fashion_mnist", ("objective.tau=.inf",)),
    # MJP Table 3 / Fig. 3 (gamma 0.15 is the main run)
    Run("mjp_gamma0.03", "mjp", "MJP gamma 0.03", "mjp_fashion_mnist", ("objective.ratio=0.03",), finetune_pe=None),
    Run("mjp_gamma0.27", "mjp", "MJP gamma 0.27", "mjp_fashion_mnist", ("objective.ratio=0.27",), finetune_pe=None,
        privacy=True),  # MJP Table 5 attacks MJP at gamma 0.27
    Run("mjp_gamma0", "mjp", "MJP gamma 0", "mjp_fashion_mnist", ("objective.ratio=0.0",), finetune_pe=None),
    # RandSAC Tables 2, 5, 7 (hierarchical blob 11 -> 5 is the main run)
    Run("randsac_patch_random", "randsac", "RandSAC patch-random", "randsac_fashion_mnist",
        ("objective.segments=patch_random", "objective.hierarchy=[]")),
    Run("randsac_raster", "randsac", "RandSAC raster", "randsac_fashion_mnist",
        ("objective.segments=raster", "objective.hierarchy=[]")),
    Run("randsac_blob_flat", "randsac", "RandSAC blob (flat)", "randsac_fashion_mnist", ("objective.hierarchy=[]",)),
    Run("randsac_square", "randsac", "RandSAC square 2x2", "randsac_fashion_mnist",
        ("objective.segments=square", "objective.hierarchy=[]")),
    # MP3 Table 5: keyword spotting with the ~70K-parameter audio Transformer
    Run("speech_supervised", "speech", "supervised Transformer", None, finetune_pe=None, speech=True),
    Run("speech_mp3", "speech", "MP3-pretrained Transformer", "mp3_speech_spoken_keywords", speech=True),
    # the null-pretraining control: the same fine-tune from a 1-step MP3 "pretraining" (speech_null)
    Run("speech_null", "speech", "null pretraining (1 step) + fine-tune", "mp3_speech_spoken_keywords",
        speech=True),
)


def fraction_key(metric: str, fraction: float) -> str:
    """The key of a label-efficiency number, e.g. ``top1@0.01`` (fine-tuned on 1% of the labels)."""
    return f"{metric}@{fraction:g}"


def group_seeds(cfg: StudyConfig, group: str) -> tuple[int, ...]:
    """The seeds a group runs: ``seeds`` (main), ``speech_seeds`` (speech), ``curve_seed`` (curves), else
    ``ablation_seeds``."""
    return {"main": cfg.seeds, "speech": cfg.speech_seeds, "curves": (cfg.curve_seed,)}.get(group,
                                                                                          cfg.ablation_seeds)


def run_seeds(cfg: StudyConfig, run: Run) -> tuple[int, ...]:
    """The seeds a row runs: ``close_seeds`` for the ``close_rows``, else its group's (:func:`group_seeds`); a row
    that fine-tunes another's pretraining runs that row's seeds."""
    return tuple(cfg.close_seeds) if (run.pretrain_from or run.name) in cfg.close_rows else group_seeds(cfg, run.group)


def runs_of(groups: tuple[str, ...], only: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> list[Run]:
    """Runs in execution order: groups as given, rows in table order (fine-tunes of a shared pretraining last);
    only the runs named in ``only`` when it is given, none named in ``skip``. The curves group has no rows of its
    own (its units name a main row each)."""
    return [r for g in groups for r in RUNS
            if r.group == g and (not only or r.name in only) and r.name not in skip]


def measures_controls(groups: tuple[str, ...] | list[str], only: tuple[str, ...] | list[str]) -> bool:
    """Whether a study process of these groups, restricted to ``only``, measures main's probe controls (on the
    first main seed, when ``controls``): main is among its groups and ``only`` is () or names "controls"."""
    return "main" in groups and (not only or CONTROLS in only)
