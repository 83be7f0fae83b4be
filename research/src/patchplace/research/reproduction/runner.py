"""Runs the study's stages — pretraining, fine-tuning (or a classifier from scratch), the learned gate, probes,
evaluation — for each (run, seed) below ``runs/``; every stage is resumable
(``patchplace.pipelines.stages.stage``) and runs its command line as a process of its own.

Protocol (``holdout`` > 0): every training stage validates on ``holdout`` images held out of the train split
(training-time evaluation, early stopping); the test split is read once per final number, by an evaluation stage of
the final (or best) checkpoint. Fine-tuning pools as each method's own protocol does (the checkpoint's
``finetune_pool``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from patchplace.data import Manifest
from patchplace.pipelines import CONFIGS
from patchplace.pipelines.engine.hardware import resolve_precision
from patchplace.pipelines.stages import by_precision, stage
from patchplace.research.reproduction.plan import Run, StudyConfig, run_seeds, runs_of
from patchplace.research.reproduction.protocol import record_start

# Every stage is its command line's main: run in this process when it trains in float32, else as a process of its
# own (python -m ...) with its own Accelerate state (a bf16 study trains in bf16 and evaluates in float32).
pretrain = by_precision("patchplace.pipelines.pretrain")
finetune = by_precision("patchplace.pipelines.finetune")
evaluate = by_precision("patchplace.pipelines.evaluate")
controls = by_precision("patchplace.research.controls")

# the pretraining configs whose head predicts positions (evaluate.py: MP3's eta curve, DropPos's grid)
POSITION_CONFIGS = ("mp3_fashion_mnist", "droppos_fashion_mnist")
# an evaluation stage owns its run.output: a retry after a failed attempt replaces that attempt's files
EVALUATE = ["--config", str(CONFIGS / "evaluate_fashion_mnist.yaml"), "run.overwrite=true"]


class Study:
    """Runs the stages of each (run, seed) below ``cfg.runs``; every stage is resumable
    (``patchplace.pipelines.stages.stage``) and runs as a process of its own."""

    def __init__(self, cfg: StudyConfig, *, train_with: dict[str, Callable[[list[str]], int]] | None = None):
        self.cfg = cfg
        self.root = Path(cfg.runs)
        # how a training stage runs pretrain.py / finetune.py (e.g. under emulated bf16 matmuls: the CPU
        # equivalence test)
        self.launch = {"pretrain": pretrain, "finetune": finetune, **(train_with or {})}
        # resolved once: a training stage's argv names its precision when it is not float32 (a float32 stage's
        # argv has no precision argument, so its DONE record matches on any machine that trains in float32)
        self.precision = resolve_precision(cfg.precision)
        # the (row, seed) directory whose start is recorded when one of its stages first runs (:meth:`stage`)
        self.unstarted: Path | None = None

    def stage(self, directory: Path, run: Callable[[list[str]], int], argv: list[str], label: str = "") -> float:
        """:func:`patchplace.pipelines.stages.stage`, which records the start of the unit being run
        (:func:`record_start`) just before the first of its stages that runs: a visit to a finished unit records
        nothing (its rows keep the machine models they ran on)."""
        def recorded(args: list[str]) -> int:
            if self.unstarted is not None:
                record_start(self.unstarted, Path(self.cfg.protocol) if self.cfg.protocol else None)
                self.unstarted = None
            return run(args)

        return stage(directory, recorded, argv, label)

    def dir(self, run: Run, seed: int) -> Path:
        """A (row, seed)'s run directory; with ``epochs_in_path`` a pretrained row's names its epochs
        (``<row>@e<epochs>``), so a doubled budget trains beside the shorter one, never into its stages."""
        pretrained = self.cfg.epochs_in_path and run.config is not None and not run.classifier_only
        return self.root / f"seed{seed}" / (f"{run.name}@e{self.epochs(run)[0]:g}" if pretrained else run.name)

    def model_overrides(self, run: Run) -> list[str]:
        """What a backbone built from the preset gets besides it: ``patch_size`` (image rows)."""
        return [] if run.speech or self.cfg.patch_size is None else \
            [f"model.overrides={{patch_size: {self.cfg.patch_size}}}"]

    def seeds(self, run: Run) -> tuple[int, ...]:
        return run_seeds(self.cfg, run)

    def data(self, run: Run, evaluation: bool = False) -> list[str]:
        """Split overrides (+ the user's extra overrides) of a training or evaluation stage."""
        c = self.cfg
        if run.speech:
            root = Path(c.spoken_keywords)
            val = root / ("test" if evaluation else "validation")
            noise = [] if evaluation else [f"data.noise_split={root / 'background_noise'}"]
            return [f"data.train={root / 'train'}", f"data.val={val}", *noise, f"data.num_workers={c.num_workers}",
                    *c.speech_overrides]
        root = Path(c.fashion_mnist)
        # training validates on the held-out images, an evaluation reads the test split (with the same images held
        # out of the train split, so its probe subsets are the ones training used)
        val = [f"data.holdout={c.holdout}"] + ([f"data.val={root / 'test'}"] if evaluation else ["data.val=holdout"]) \
            if c.holdout else [f"data.val={root / 'test'}"]
        return [f"data.train={root / 'train'}", *val, f"data.num_workers={c.num_workers}", *c.overrides]

    def common(self, run: Run, seed: int) -> list[str]:
        c = self.cfg
        precision = [] if self.precision.value == "no" else [f"run.mixed_precision={self.precision.value}"]
        args = [f"run.seed={seed}", "run.tensorboard=false", "run.resume=true", "run.checkpoint_every=50",
                *self.data(run), *precision]
        # training-time validation only feeds the log (the eval stage measures the test set): 1,000 images
        val = min(c.holdout or c.test_samples or 1000, 1000)
        return args if run.speech else [*args, f"model.preset={c.preset}", f"data.batch_size={c.batch_size}",
                                        f"data.val_limit={val}"]

    def steps_per_epoch(self, batch: int) -> float:
        """Optimizer steps per epoch over the train split (what the holdout leaves)."""
        n = Manifest.load(Path(self.cfg.fashion_mnist) / "train").num_samples - self.cfg.holdout
        return max(1.0, n / batch)

    def epochs(self, run: Run) -> tuple[float, float]:
        c = self.cfg
        if run.speech:
            return c.speech_pretrain_epochs, c.speech_finetune_epochs
        return float(c.row_pretrain_epochs.get(run.name, c.pretrain_epochs)), c.finetune_epochs

    def gated(self, run: Run) -> bool:
        """Whether the learned gate reads this row: its own image pretraining (not speech, not a classifier)."""
        return self.cfg.gate and not run.speech and not run.classifier_only

    # ------------------------------------------------------------------------------------------ stages
    def probe_only(self, run: Run) -> bool:
        return run.group in self.cfg.probe_only and run.group != "main"

    def full_label(self, run: Run, seed: int) -> bool:
        """Whether this (run, seed) is fine-tuned with all labels (``full_label_rows``: the others of main only on
        the first seed, or not at all without ``first_seed_finetunes``)."""
        rows = self.cfg.full_label_rows
        if run.group == "main" and seed not in self.cfg.seeds:  # a close_seeds extra: pretrained, probed, gated
            return False
        if run.group == "main" and rows and run.name not in rows:
            return self.cfg.first_seed_finetunes and seed == self.cfg.seeds[0]
        return True

    def supervised(self, run: Run, seed: int, out: Path, epochs: float, extra: list[str]) -> float:
        """A classifier trained from scratch: supervised (the fine-tuning recipe without layer decay) or MJP (its
        own supervised recipe, pretrain.py)."""
        common = [f"run.output={out}", f"optim.epochs={epochs}", *self.common(run, seed), *self.model_overrides(run)]
        if run.config is None:
            pe = "sincos1d" if run.speech else "learned"
            if run.speech:
                extra = [*self.speech_stopping(), *extra]
            return self.stage(out, self.launch["finetune"], ["--config", str(self.finetune_config(run)), *common,
                                              "optim.layer_decay=null", f"finetune.pos_embed={pe}",
                                              *self.finetune_extra(run), *extra], label=f"{out} train")
        return self.stage(out, self.launch["pretrain"], ["--config", str(CONFIGS / f"{run.config}.yaml"), *common,
                                                    *run.objective,
                                          *extra], label=f"{out} train")

    def finetune(self, run: Run, seed: int, out: Path, epochs: float, extra: list[str]) -> float:
        """Fine-tune this run's pretrained backbone (the fine-tuning recipe + ``finetune_overrides``)."""
        pe = "null" if run.finetune_pe == "keep" else run.finetune_pe
        checkpoint = self.dir(run, seed) / "pretrain" / "checkpoint"
        if run.speech:
            extra = [*self.speech_stopping(), *extra]
        return self.stage(out, self.launch["finetune"], [
            "--config", str(self.finetune_config(run)), f"run.output={out}", f"optim.epochs={epochs}",
            f"model.checkpoint={checkpoint}", f"finetune.pos_embed={pe}", *self.common(run, seed),
            *self.finetune_extra(run), *extra], label=f"{out} finetune")

    def finetune_config(self, run: Run) -> Path:
        return CONFIGS / ("finetune_spoken_keywords.yaml" if run.speech else "finetune_fashion_mnist.yaml")

    def finetune_extra(self, run: Run) -> list[str]:
        return [] if run.speech else list(self.cfg.finetune_overrides)

    def speech_stopping(self) -> list[str]:
        """Speech training (MP3 §4.3: "early stopping is done based on validation accuracy"): evaluate every
        ``speech_eval_epochs`` and stop after ``speech_patience`` evaluations without a better top-1."""
        c = self.cfg
        if not c.speech_patience:
            return []
        train = Manifest.load(Path(c.spoken_keywords) / "train").num_samples
        batch = next((int(o.split("=")[1]) for o in c.speech_overrides if o.startswith("data.batch_size=")), 64)
        every = max(1, round(c.speech_eval_epochs * train / batch))
        return [f"run.eval_every={every}", f"run.early_stop_patience={c.speech_patience}"]

    @staticmethod
    def final(out: Path) -> Path:
        """The checkpoint a training stage's final number reads: ``best/`` when it stopped on validation, else its
        last checkpoint."""
        return out / "best" if (out / "best").is_dir() else out / "checkpoint"

    def train(self, run: Run, seed: int) -> tuple[Path, Path | None, dict[str, float]]:
        """-> (backbone checkpoint to probe, classifier checkpoint (None: probes only), stage seconds)."""
        d, (pre, ft) = self.dir(run, seed), self.epochs(run)
        seconds = {}
        if run.classifier_only:  # images: supervised / MJP from scratch, the same total epochs; speech: as many
            epochs = ft if run.speech else (self.cfg.classifier_epochs or pre + ft)
            seconds["train"] = self.supervised(run, seed, d / "train", epochs, self.classifier_stopping(run))
            return self.final(d / "train"), self.final(d / "train"), seconds
        seconds["pretrain"] = self.stage(d / "pretrain", self.launch["pretrain"], [
            "--config", str(CONFIGS / f"{run.config}.yaml"), f"run.output={d / 'pretrain'}",
            f"optim.epochs={pre}", *run.objective, *self.common(run, seed), *self.model_overrides(run)],
            label=f"{d} pretrain")
        if self.probe_only(run) or not self.full_label(run, seed):
            return d / "pretrain" / "checkpoint", None, seconds
        seconds["finetune"] = self.finetune(run, seed, d / "finetune", ft, [])
        return d / "pretrain" / "checkpoint", self.final(d / "finetune"), seconds

    def classifier_stopping(self, run: Run) -> list[str]:
        """An image classifier trained from scratch with every label (``classifier_patience``): validation every
        ``classifier_eval_epochs`` on all the held-out images, stopped after that many evaluations without a better
        top-1 (the best checkpoint is the one tested)."""
        c = self.cfg
        if run.speech or not c.classifier_patience or not c.holdout:
            return []
        every = max(1, round(c.classifier_eval_epochs * self.steps_per_epoch(c.batch_size)))
        return [f"run.eval_every={every}", f"run.early_stop_patience={c.classifier_patience}",
                f"data.val_limit={c.holdout}"]

    def probe(self, run: Run, out: Path, backbone: Path) -> None:
        """Probes of a backbone on the test split: linear on the all-label probe set (and its 1% subset), the MP3
        eta curve / DropPos grid of its pretraining head."""
        c = self.cfg
        self.stage(out, evaluate, [
            *EVALUATE, f"run.output={out}",
            f"model.checkpoint={backbone}", f"eval.probe_train_samples={c.probe_train_samples}",
            f"eval.probe_epochs={c.probe_epochs}", f"eval.max_eval_samples={c.curve_samples}",
            f"data.val_limit={c.probe_val_samples}", "eval.consistency_ratios=[]",
            "eval.label_fractions=[]", "eval.knn=false", "eval.position_probe=false",
            f"data.label_subset_seed={c.label_subset_seed}", *self.data(run, evaluation=True)], label=f"{out}")

    def gate(self, run: Run, seed: int, backbone: Path) -> None:
        """The learned gate's numbers for one (row, seed), on the validation split only: the linear probe of the
        pretrained features on the all-label probe set, beside the
        random init of the same architecture and feature on the same seed (and raw pixels): ``<run>/gate``."""
        c, d = self.cfg, self.dir(run, seed)
        saved = json.loads((backbone / "config.json").read_text())
        feature = f"{saved['backbone']['pos_embed']}/{saved['metadata'].get('probe_feature', 'mean')}"
        self.stage(d / "gate", controls, [
            "--config", str(CONFIGS / "controls_fashion_mnist.yaml"), f"run.output={d / 'gate'}",
            f"controls.seeds=[{seed}]", f"model.preset={c.preset}", f"controls.random_inits=[{feature}]",
            "controls.label_fractions=[]", f"controls.probe_train_samples={c.probe_train_samples}",
            f"controls.probe_epochs={c.probe_epochs}", f"controls.checkpoints=[{backbone}]",
            f"data.label_subset_seed={c.label_subset_seed}", *self.data(run), *self.model_overrides(run),
            f"data.val_limit={min(c.gate_val_samples, c.holdout)}"], label=f"{d} gate")

    def position_validation(self, run: Run, seed: int, backbone: Path) -> None:
        """The MP3 eta curve / DropPos grid of a position row's pretraining head on the validation split
        (``validation_positions``; ``<run>/position_val``): what a protocol's regime and doubling rule read, never
        the test split."""
        c, d = self.cfg, self.dir(run, seed)
        self.stage(d / "position_val", evaluate, [
            *EVALUATE, f"run.output={d / 'position_val'}", f"model.checkpoint={backbone}",
            "eval.linear_probe=false", "eval.knn=false", "eval.position_probe=false", "eval.consistency_ratios=[]",
            f"eval.max_eval_samples={min(c.curve_samples, c.holdout)}", *self.data(run)], label=f"{d} position_val")

    def evaluate(self, run: Run, seed: int, backbone: Path, classifier: Path | None) -> None:
        c, d = self.cfg, self.dir(run, seed)
        data = self.data(run, evaluation=True)
        if run.speech:  # one evaluation on the test split: top-1 + probes of the fine-tuned model
            self.stage(d / "eval", evaluate, [
                *EVALUATE, f"run.output={d / 'eval'}",
                f"model.checkpoint={classifier}", "data.pad_to=null", "eval.position_probe=false",
                f"eval.probe_epochs={c.probe_epochs}", *data], label=f"{d} eval")
            return
        limit = [f"data.val_limit={c.test_samples}"] if c.test_samples else []
        # probes of the backbone (the pretrained one, or the classifier's own)
        if self.gated(run) and c.holdout:  # the learned gate first: it reads validation only
            self.gate(run, seed, backbone)
        self.probe(run, d / "probe", backbone)
        if c.validation_positions and c.holdout and run.config in POSITION_CONFIGS:
            self.position_validation(run, seed, backbone)
        if classifier is None:
            return
        self.stage(d / "eval", evaluate, [
            *EVALUATE, f"run.output={d / 'eval'}",
            f"model.checkpoint={classifier}", "eval.linear_probe=false", "eval.knn=false",
            "eval.position_probe=false", "eval.probe_train_samples=128", f"eval.max_eval_samples={c.curve_samples}",
            *data, *limit], label=f"{d} eval")

    def run_all(self) -> None:
        """Every stage of the configured units (``groups``, ``only``, ``skip``, ``only_seeds``)."""
        for run in runs_of(self.cfg.groups, self.cfg.only, self.cfg.skip):
            for seed in (s for s in self.seeds(run) if not self.cfg.only_seeds or s in self.cfg.only_seeds):
                start = time.perf_counter()
                self.unstarted = self.dir(run, seed)
                backbone, classifier, _ = self.train(run, seed)
                self.evaluate(run, seed, backbone, classifier)
                print(f"[study] {run.name} seed {seed}: {(time.perf_counter() - start) / 60:.1f} min this call",
                      flush=True)
                self.unstarted = None
