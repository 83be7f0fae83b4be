"""The study's plan: its budget knobs (:class:`StudyConfig`), the groups, and one :class:`Run` per table row (how
its backbone is trained, how its classifier is obtained)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from patchplace.objectives.declarations import known_methods  # the registrations' facts, without importing torch
from patchplace.pipelines.config import ConfigError

GROUPS = ("main", "mp3_eta", "droppos", "speech")


@dataclass
class StudyConfig:
    """Budget knobs of the study (one place). The defaults are the CPU budget of a row trained on Fashion-MNIST
    (also what ``benchmark.py --suite cpu_equivalence`` trains); a protocol's config sets every knob it reads."""

    preset: str = "vit_cpu_narrow"  # the one ViT of every image run
    pretrain_epochs: float = 0.5  # image pretraining epochs per method
    finetune_epochs: float = 0.5  # fine-tuning epochs after a pretraining
    seeds: tuple[int, ...] = (0, 1, 2)  # main table
    # validation: this many class-balanced images held out of the train split (data.holdout); every training stage
    # validates on them (training-time evaluation, early stopping), the test split is read once per final number;
    # label subsets and probe sets are drawn from the rest. 0: validate on the test split (no held-out split)
    holdout: int = 5000
    # speech (MP3 §4.3): fine-tuning gets as many updates as the supervised run, early stopping on validation
    speech_patience: int = 0  # evaluations (every speech_eval_epochs) without a better validation top-1; 0: off
    speech_eval_epochs: float = 5.0  # speech epochs between validation evaluations
    # main rows fine-tuned with all labels on every seed (the rows a full-label claim reads); the other main rows
    # only on the first seed (their pretraining and probes still take every seed). () = every main row, every seed
    full_label_rows: tuple[str, ...] = ()
    # with full_label_rows: whether the other main rows are fine-tuned on the first seed (false: probed only, no
    # fine-tune / evaluation at all: the rows no claim reads cost nothing but their pretraining and probes)
    first_seed_finetunes: bool = True
    label_subset_seed: int = 0  # which balanced 1% subset the low-label probe reads (the same for every row)
    ablation_seeds: tuple[int, ...] = (0, 1, 2)  # seeds of the ablation groups
    # rows that run close_seeds instead of their group's seeds (e.g. 5 where a claim is close to decidable); a main
    # row's extra seeds are pretrained, probed and gated only (full-label fine-tunes stay on seeds)
    close_rows: tuple[str, ...] = ()
    close_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # the seeds of the close_rows
    # pretraining epochs of named rows instead of pretrain_epochs: {row: epochs}; rows compared by a claim get the
    # same budget
    row_pretrain_epochs: dict[str, Any] = field(default_factory=dict)
    # the learned gate (gate.py): every pretrained row's frozen features, linear probe on the all-label probe set
    # scored on gate_val_samples validation images, beside the random init of its architecture and feature (same
    # seed); a row is learned where a one-sided Welch test over >= 3 seeds beats that control at alpha 0.05
    gate: bool = True
    gate_val_samples: int = 5000  # validation images the gate's probes are scored on
    groups: tuple[str, ...] = GROUPS  # in priority order: each process runs its groups in this order
    only: tuple[str, ...] = ()  # run names to restrict the groups to (e.g. the rows a protocol reads); () = all
    skip: tuple[str, ...] = ()  # run names left out of their groups (e.g. rows no claim reads at this budget)
    only_seeds: tuple[int, ...] = ()  # seeds this process runs (study.py --jobs gives each process its own); () = all
    # study.py's units (--jobs): one per (row, seed) instead of one per (group, seed): finer units keep every --jobs
    # process busy to the end
    unit_per_row: bool = False
    probe_only: tuple[str, ...] = ()  # ablation groups evaluated by probes only (no fine-tuning; not main)
    batch_size: int = 128  # image stages, per process
    num_workers: int = 1  # data.num_workers of every stage (decoding shards; streaming workers)
    threads: int = 0  # torch threads per study process (0: torch's default)
    # the training stages' run.mixed_precision: auto (resolved once at start on this machine, engine/hardware.py:
    # bf16 only where the device has bf16 units and bf16 training passed its equivalence test) | no | bf16
    precision: str = "auto"
    # on the fine-tuning recipe: no Mixup / CutMix, no layer decay (the short budget's recipe)
    finetune_overrides: tuple[str, ...] = ("finetune.mixup=0.0", "finetune.cutmix=0.0", "optim.layer_decay=null")
    # recipe choices this config carries that were not confirmed on the validation split: listed in the report
    unverified_recipe: tuple[str, ...] = ()
    probe_train_samples: int = 5000  # train images of the (all-label) linear probe
    probe_val_samples: int = 5000  # test images the probes are scored on
    probe_epochs: int = 100  # epochs of each linear probe
    curve_samples: int = 1000  # images of the MP3 eta / DropPos grid curves
    speech_pretrain_epochs: float = 20.0  # MP3 speech pretraining epochs
    speech_finetune_epochs: float = 30.0  # speech fine-tuning epochs (supervised: as many, from scratch; §4.3)
    speech_seeds: tuple[int, ...] = (0, 1, 2)  # seeds of the speech rows
    test_samples: int | None = 5000  # cap on test images for top-1 (None: all 10,000)
    fashion_mnist: str = "shards/fashion_mnist"  # image shards: train/ and test/
    spoken_keywords: str = "shards/spoken_keywords"  # speech shards: train/, test/, background_noise/
    # section.field=value for every image training / evaluation stage (default: crop scale [0.8, 1])
    overrides: tuple[str, ...] = ("data.scale=[0.8, 1.0]",)
    speech_overrides: tuple[str, ...] = ()  # section.field=value for every speech stage
    runs: str = "runs/study"  # run directories: <runs>/seed<k>/<run>/<stage>/
    results: str = "results"  # where <name>.json / .md go
    name: str = "study"  # results files: <results>/<name>.json, <name>.md
    # the pre-registered protocol (e.g. research/protocols/study_v5.yaml): its claims, regimes, seeds and epochs
    # decide the report, rows record its sha256 and are refused when trained before its commit; None: the stages
    # run and no report is written
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
        if not set(self.probe_only) <= set(GROUPS) - {"main", "speech"}:
            raise ConfigError(f"probe_only: only pretraining ablation groups (mp3_eta, droppos), got "
                              f"{list(self.probe_only)}")
        if not self.seeds or not self.ablation_seeds or not self.speech_seeds:
            raise ConfigError("seeds, ablation_seeds and speech_seeds need at least one seed each")
        if self.precision not in ("auto", "no", "bf16"):
            raise ConfigError(f"precision must be auto, no or bf16, got {self.precision!r}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        for knob, names in (("only", self.only), ("skip", self.skip)):
            unknown = sorted(set(names) - {r.name for r in RUNS})
            if unknown:
                raise ConfigError(f"{knob}: unknown run(s) {unknown}; known: {[r.name for r in RUNS]}")
        if set(self.skip) & {r.name for r in RUNS if r.group == "main"}:
            raise ConfigError(f"skip: main rows are the study's table; drop their groups or seeds instead, got "
                              f"{sorted(self.skip)}")
        unknown = sorted(set(self.full_label_rows) - {r.name for r in RUNS if r.group == "main"})
        if unknown:
            raise ConfigError(f"full_label_rows: {unknown} are not main rows; main: "
                              f"{[r.name for r in RUNS if r.group == 'main']}")
        if self.speech_eval_epochs <= 0 or self.speech_patience < 0 or self.holdout < 0:
            raise ConfigError("speech_eval_epochs must be > 0, speech_patience and holdout >= 0")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name must be a plain file stem (e.g. study_v5), got {self.name!r}")
        rows = {r.name for r in RUNS}
        unknown = sorted((set(self.close_rows) | set(self.row_pretrain_epochs)) - rows)
        if unknown:
            raise ConfigError(f"close_rows / row_pretrain_epochs: unknown run(s) {unknown}; known: {sorted(rows)}")
        if self.close_rows and not self.close_seeds:
            raise ConfigError("close_seeds needs at least one seed")
        for name, epochs in self.row_pretrain_epochs.items():
            if not isinstance(epochs, int | float) or epochs <= 0:
                raise ConfigError(f"row_pretrain_epochs.{name}: epochs > 0, got {epochs!r}")
        if self.gate_val_samples < 1:
            raise ConfigError("gate_val_samples must be >= 1")
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
    speech: bool = False

    @property
    def classifier_only(self) -> bool:
        return self.finetune_pe is None


def main_row(method: str) -> Run:
    """The main-table row of a registered method, from its registration: its name (display), its Fashion-MNIST
    pretraining config, fine-tuned with the checkpoint's PE (a learned one when it pretrains without any), or,
    when it trains through a classifier head (MJP: a supervised recipe, not a pretraining), that classifier."""
    spec = known_methods()[method]
    finetune_pe = None if spec.needs_head else "learned" if spec.pos_embed == "none" else "keep"
    return Run(method, "main", spec.display, f"{method}_fashion_mnist", finetune_pe=finetune_pe)


RUNS: tuple[Run, ...] = (
    # main table: same backbone, same data, same total epochs; the supervised baseline trains from scratch
    Run("supervised", "main", known_methods()["supervised"].display, None, finetune_pe=None),
    *map(main_row, ("mp3", "droppos", "mae", "ijepa", "stop", "randsac", "mjp")),
    # MP3 Fig. 3: masking ratio eta of pretraining (0.5 is the main run)
    Run("mp3_eta0.75", "mp3_eta", "MP3 eta 0.75", "mp3_fashion_mnist", ("objective.eta=0.75",),
        finetune_pe="learned"),
    Run("mp3_eta0", "mp3_eta", "MP3 eta 0", "mp3_fashion_mnist", ("objective.eta=0.0",), finetune_pe="learned"),
    # DropPos Table 3: position smoothing sigma 1 -> 0 (sigma 1 is the main run)
    Run("droppos_sigma0", "droppos", "DropPos sigma 0", "droppos_fashion_mnist",
        ("objective.sigma_start=0.0", "objective.sigma_end=0.0")),
    # MP3 Table 5: keyword spotting with the ~70K-parameter audio Transformer
    Run("speech_supervised", "speech", "supervised Transformer", None, finetune_pe=None, speech=True),
    Run("speech_mp3", "speech", "MP3-pretrained Transformer", "mp3_speech_spoken_keywords", speech=True),
)


def group_seeds(cfg: StudyConfig, group: str) -> tuple[int, ...]:
    """The seeds a group runs: ``seeds`` (main), ``speech_seeds`` (speech), else ``ablation_seeds``."""
    return {"main": cfg.seeds, "speech": cfg.speech_seeds}.get(group, cfg.ablation_seeds)


def run_seeds(cfg: StudyConfig, run: Run) -> tuple[int, ...]:
    """The seeds a row runs: ``close_seeds`` for the ``close_rows``, else its group's (:func:`group_seeds`)."""
    return tuple(cfg.close_seeds) if run.name in cfg.close_rows else group_seeds(cfg, run.group)


def runs_of(groups: tuple[str, ...], only: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> list[Run]:
    """Runs in execution order: groups as given, rows in table order; only the runs named in ``only`` when it is
    given, none named in ``skip``."""
    return [r for g in groups for r in RUNS
            if r.group == g and (not only or r.name in only) and r.name not in skip]
