"""Reproduction study: every method on the same data, backbone and budget, then the ablations that carry each
paper's claim, in miniature; results (JSON, markdown tables, PNGs) go to ``results/``.

    make study                                                         # = the line below
    python pipelines/study.py --config pipelines/configs/study_fashion_mnist.yaml
    python pipelines/study.py --config pipelines/configs/study_fashion_mnist.yaml groups=[main] seeds=[0,1,2]
    python pipelines/study.py --config pipelines/configs/study_fashion_mnist.yaml --report-only

Fashion-MNIST padded to 32 x 32, patch 4 (64 positions, the MP3 CIFAR setting), one small ViT (``preset``) for all
methods. Each pretraining method is followed by the same fine-tuning recipe (``finetune_fashion_mnist.yaml`` +
``finetune_overrides``); the supervised baseline and MJP (a supervised recipe) train from scratch for the same
*total* epochs. Per run: PyTorch evaluation (top-1, MJP consistency / Diff. Norm over eval gamma), probes of the
backbone (linear at 100% and 1% of the labels, kNN per layer, position probe, MP3 eta curve, DropPos grid), and for
the main table the ONNX export + ONNX Runtime evaluation (top-1, corruption errors -> mCE vs the supervised run).

Groups (``groups=[...]``): main, mp3_pe (MP3 Table 3), mp3_eta (Figs. 3 and 6), droppos (Tables 1, 3, 4), mjp
(Table 3, Fig. 3), randsac (Tables 2, 5, 7), speech (MP3 Table 5). StoP vs I-JEPA (Tables 1, 6) is in main.

Resumable: every stage of every run leaves ``DONE`` and a killed run resumes from its last checkpoint; two study
processes may run different groups at once (a stage being run by one is refused to the other). The budget knobs are
all in the config (epochs, seeds, probe sizes, threads); the defaults finish on a 2-core CPU in the time stated in
``study_fashion_mnist.yaml``, and scale up by config on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import evaluate
import finetune
import pretrain
import torch
from config import ConfigError, describe, load
from stages import StageError, hardware_line, stage, stage_seconds

from patchplace.data.atomic import atomic_file, write_json_atomic
from patchplace.export.__main__ import main as export_main
from patchplace.export.evaluate import main as ort_evaluate_main

CONFIGS = Path(__file__).parent / "configs"
GROUPS = ("main", "mp3_pe", "mp3_eta", "droppos", "mjp", "randsac", "speech")


@dataclass
class StudyConfig:
    """Budget knobs of the study (one place)."""

    preset: str = "vit_cpu_narrow"  # the one ViT of every image run
    pretrain_epochs: float = 0.25
    finetune_epochs: float = 0.25  # supervised / MJP train pretrain_epochs + finetune_epochs from scratch
    seeds: tuple[int, ...] = (0,)  # main table
    ablation_seeds: tuple[int, ...] = (0,)
    groups: tuple[str, ...] = GROUPS  # in priority order: each process runs its groups in this order
    only: tuple[str, ...] = ()  # run names to restrict the groups to (e.g. add seeds to some rows); () = all
    probe_only: tuple[str, ...] = ()  # ablation groups evaluated by probes only (no fine-tuning; not main)
    batch_size: int = 128
    num_workers: int = 1
    threads: int = 0  # torch threads per study process (0: torch's default)
    finetune_overrides: tuple[str, ...] = ("finetune.mixup=0.0", "finetune.cutmix=0.0")
    probe_train_samples: int = 2000
    probe_val_samples: int = 2000
    probe_epochs: int = 100
    curve_samples: int = 1000  # test images for the consistency / eta / DropPos-grid curves
    ort_consistency_samples: int = 1000
    robustness_samples: int = 200  # test images x 13 corruptions x 5 severities (ONNX Runtime)
    speech_pretrain_epochs: float = 20.0
    speech_finetune_epochs: float = 30.0
    speech_seeds: tuple[int, ...] = (0, 1, 2)
    privacy_images: int = 10  # MJP Table 5 gradient inversion: one test image per class (0: skip)
    privacy_steps: int = 200  # gradient-matching attack steps per client update (APRIL's analytic attack: exact)
    test_samples: int | None = None  # cap on test images for top-1 (None: all 10,000)
    fashion_mnist: str = "shards/fashion_mnist"  # image shards: train/ and test/
    spoken_keywords: str = "shards/spoken_keywords"  # speech shards: train/, test/, background_noise/
    overrides: tuple[str, ...] = ()  # section.field=value for every image training / evaluation stage
    speech_overrides: tuple[str, ...] = ()
    runs: str = "runs/study"
    results: str = "results"

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
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        unknown = sorted(set(self.only) - {r.name for r in RUNS})
        if unknown:
            raise ConfigError(f"only: unknown run(s) {unknown}; known: {[r.name for r in RUNS]}")
        if self.privacy_images < 0 or self.privacy_steps < 1:
            raise ConfigError("privacy_images must be >= 0 and privacy_steps >= 1")


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

    @property
    def classifier_only(self) -> bool:
        return self.finetune_pe is None


RUNS: tuple[Run, ...] = (
    # main table: same backbone, same data, same total epochs
    Run("supervised", "main", "supervised", None, finetune_pe=None, ort=True, privacy=True),
    Run("mp3", "main", "MP3", "mp3_fashion_mnist", finetune_pe="learned", ort=True),
    Run("droppos", "main", "DropPos", "droppos_fashion_mnist", ort=True),
    Run("mae", "main", "MAE", "mae_fashion_mnist", ort=True),
    Run("ijepa", "main", "I-JEPA", "ijepa_fashion_mnist", ort=True),
    Run("stop", "main", "StoP", "stop_fashion_mnist", ort=True),
    Run("randsac", "main", "RandSAC", "randsac_fashion_mnist", ort=True),
    Run("mjp", "main", "MJP", "mjp_fashion_mnist", finetune_pe=None, ort=True),
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
)


def runs_of(groups: tuple[str, ...], only: tuple[str, ...] = ()) -> list[Run]:
    """Runs in execution order: groups as given, rows in table order (fine-tunes of a shared pretraining last);
    only the runs named in ``only`` when it is given."""
    return [r for g in groups for r in RUNS if r.group == g and (not only or r.name in only)]


class Study:
    """Runs the stages of each (run, seed) below ``cfg.runs``; every stage is resumable (stages.stage)."""

    def __init__(self, cfg: StudyConfig):
        self.cfg = cfg
        self.root = Path(cfg.runs)

    def dir(self, run: Run, seed: int) -> Path:
        return self.root / f"seed{seed}" / run.name

    def seeds(self, run: Run) -> tuple[int, ...]:
        if run.speech:
            return self.cfg.speech_seeds
        return self.cfg.seeds if run.group == "main" else self.cfg.ablation_seeds

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
        return [f"data.train={root / 'train'}", f"data.val={root / 'test'}", f"data.num_workers={c.num_workers}",
                *c.overrides]

    def common(self, run: Run, seed: int) -> list[str]:
        c = self.cfg
        args = [f"run.seed={seed}", "run.tensorboard=false", "run.resume=true", "run.checkpoint_every=50",
                *self.data(run)]
        # training-time validation only feeds the log (the eval stage measures the test set): 1,000 images
        return args if run.speech else [*args, f"model.preset={c.preset}", f"data.batch_size={c.batch_size}",
                                        f"data.val_limit={min(c.test_samples or 1000, 1000)}"]

    def epochs(self, run: Run) -> tuple[float, float]:
        c = self.cfg
        return (c.speech_pretrain_epochs, c.speech_finetune_epochs) if run.speech else (c.pretrain_epochs,
                                                                                         c.finetune_epochs)

    # ------------------------------------------------------------------------------------------ stages
    def probe_only(self, run: Run) -> bool:
        return run.group in self.cfg.probe_only and run.group != "main"

    def train(self, run: Run, seed: int) -> tuple[Path, Path | None, dict[str, float]]:
        """-> (backbone checkpoint to probe, classifier checkpoint (None: probes only), stage seconds)."""
        d, (pre, ft) = self.dir(run, seed), self.epochs(run)
        common, seconds = self.common(run, seed), {}
        ft_config = CONFIGS / ("finetune_spoken_keywords.yaml" if run.speech else "finetune_fashion_mnist.yaml")
        ft_extra = [] if run.speech else list(self.cfg.finetune_overrides)
        if run.config is None:  # supervised from scratch, the fine-tuning recipe without layer decay
            pe = "sincos1d" if run.speech else run.scratch_pe
            seconds["train"] = stage(d / "train", finetune.main, [
                "--config", str(ft_config), f"run.output={d / 'train'}", f"optim.epochs={pre + ft}",
                "optim.layer_decay=null", f"finetune.pos_embed={pe}", *common, *ft_extra], label=f"{d} train")
            return d / "train" / "checkpoint", d / "train" / "checkpoint", seconds
        if run.classifier_only:  # MJP: a supervised recipe, from scratch, same total epochs
            seconds["train"] = stage(d / "train", pretrain.main, [
                "--config", str(CONFIGS / f"{run.config}.yaml"), f"run.output={d / 'train'}",
                f"optim.epochs={pre + ft}", *run.objective, *common], label=f"{d} train")
            return d / "train" / "checkpoint", d / "train" / "checkpoint", seconds
        source = self.dir(next(r for r in RUNS if r.name == run.pretrain_from), seed) if run.pretrain_from else d
        seconds["pretrain"] = stage(source / "pretrain", pretrain.main, [
            "--config", str(CONFIGS / f"{run.config}.yaml"), f"run.output={source / 'pretrain'}",
            f"optim.epochs={pre}", *run.objective, *common], label=f"{source} pretrain")
        if self.probe_only(run):
            return source / "pretrain" / "checkpoint", None, seconds
        pe = "null" if run.finetune_pe == "keep" else run.finetune_pe
        seconds["finetune"] = stage(d / "finetune", finetune.main, [
            "--config", str(ft_config), f"run.output={d / 'finetune'}", f"optim.epochs={ft}",
            f"model.checkpoint={source / 'pretrain' / 'checkpoint'}", f"finetune.pos_embed={pe}", *common,
            *ft_extra], label=f"{d} finetune")
        return source / "pretrain" / "checkpoint", d / "finetune" / "checkpoint", seconds

    def evaluate(self, run: Run, seed: int, backbone: Path, classifier: Path | None) -> None:
        c, d = self.cfg, self.dir(run, seed)
        data = self.data(run, evaluation=True)
        if run.speech:  # one evaluation on the test split: top-1 + probes of the fine-tuned model
            stage(d / "eval", evaluate.main, [
                "--config", str(CONFIGS / "evaluate_fashion_mnist.yaml"), f"run.output={d / 'eval'}",
                f"model.checkpoint={classifier}", "data.pad_to=null", "eval.position_probe=false",
                f"eval.probe_epochs={c.probe_epochs}", *data], label=f"{d} eval")
            return
        limit = [f"data.val_limit={c.test_samples}"] if c.test_samples else []
        if not run.pretrain_from:  # probes of the backbone (the pretrained one, or the classifier's own)
            stage(d / "probe", evaluate.main, [
                "--config", str(CONFIGS / "evaluate_fashion_mnist.yaml"), f"run.output={d / 'probe'}",
                f"model.checkpoint={backbone}", f"eval.probe_train_samples={c.probe_train_samples}",
                f"eval.probe_epochs={c.probe_epochs}", f"eval.max_eval_samples={c.curve_samples}",
                f"data.val_limit={c.probe_val_samples}", "eval.consistency_ratios=[]", *data],
                label=f"{d} probe")
        if classifier is None:
            return
        stage(d / "eval", evaluate.main, [
            "--config", str(CONFIGS / "evaluate_fashion_mnist.yaml"), f"run.output={d / 'eval'}",
            f"model.checkpoint={classifier}", "eval.linear_probe=false", "eval.knn=false",
            "eval.position_probe=false", "eval.probe_train_samples=128", f"eval.max_eval_samples={c.curve_samples}",
            *data, *limit], label=f"{d} eval")
        if run.ort:
            onnx = d / "export" / "model.onnx"
            stage(d / "export", export_main, [str(classifier), "--out", str(onnx)], label=f"{d} export")
            stage(d / "ort", ort_evaluate_main, [
                str(onnx), "--data", str(Path(c.fashion_mnist) / "test"), "--out", str(d / "ort"),
                *(["--limit", str(c.test_samples)] if c.test_samples else []),
                "--consistency-limit", str(c.ort_consistency_samples), "--robustness-limit",
                str(c.robustness_samples), "--latency-repeats", "0", "--corruption-cache",
                str(self.root / "corruptions")], label=f"{d} ort")
        if run.privacy and c.privacy_images:  # MJP Table 5: the same images and attack budget for every model
            stage(d / "privacy", evaluate.main, [
                "--privacy", "--config", str(CONFIGS / "evaluate_fashion_mnist.yaml"), f"run.output={d / 'privacy'}",
                f"model.checkpoint={classifier}", "eval.linear_probe=false", "eval.knn=false",
                "eval.position_probe=false", "eval.consistency_ratios=[]", "eval.max_eval_samples=16",
                f"privacy.images={c.privacy_images}", f"privacy.steps={c.privacy_steps}", *data,
                f"data.val_limit={min(c.test_samples or 1000, 1000)}"], label=f"{d} privacy")

    def run_all(self) -> None:
        for run in runs_of(self.cfg.groups, self.cfg.only):
            for seed in self.seeds(run):
                start = time.perf_counter()
                backbone, classifier, _ = self.train(run, seed)
                self.evaluate(run, seed, backbone, classifier)
                print(f"[study] {run.name} seed {seed}: {(time.perf_counter() - start) / 60:.1f} min this call",
                      flush=True)


# ------------------------------------------------------------------------------------------------ results
def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def metrics_of(study: Study, run: Run, seed: int) -> dict[str, Any] | None:
    """The numbers of one (run, seed), or None when its classifier evaluation has not finished."""
    d = study.dir(run, seed)
    ev = read_json(d / "eval" / "results.json")
    source = study.dir(next(r for r in RUNS if r.name == run.pretrain_from), seed) if run.pretrain_from else d
    probe = ev if run.speech else read_json(source / "probe" / "results.json") or {}
    if ev is None and not (study.probe_only(run) and probe):
        return None
    ev = ev or {}
    ort = read_json(d / "ort" / "results.json") or {}
    pre, ft = study.epochs(run)
    m: dict[str, Any] = {"seed": seed, "top1": ev["classification"]["top1"] if ev else None}
    if study.probe_only(run):
        m.update(pretrain_epochs=pre, finetune_epochs=0.0, minutes=(stage_seconds(d / "pretrain") or 0) / 60,
                 finetune_pe="(probes only)")
    elif run.config is None or run.classifier_only:
        m.update(pretrain_epochs=0.0, finetune_epochs=pre + ft, minutes=(stage_seconds(d / "train") or 0) / 60,
                 finetune_pe=run.scratch_pe if not run.speech else "sincos1d")
    else:
        m.update(pretrain_epochs=pre, finetune_epochs=ft,
                 minutes=((stage_seconds(source / "pretrain") or 0) + (stage_seconds(d / "finetune") or 0)) / 60,
                 finetune_pe={"keep": "sincos1d" if run.speech else "sincos2d (kept)"}.get(run.finetune_pe,
                                                                                           run.finetune_pe))
    if "consistency" in ev:
        m["consistency_curve"] = ev["consistency"]
        if "0.15" in ev["consistency"]:
            m["consistency"] = ev["consistency"]["0.15"]["consistency"]
            m["diff_norm"] = ev["consistency"]["0.15"]["diff_norm"]
    if "linear_probe" in probe:
        m["linear_probe"] = probe["linear_probe"]["top1"]
        m["linear_probe_1pct"] = probe["linear_probe_low_label"]["top1"]
    if "knn_per_layer" in probe:
        layer, value = max(probe["knn_per_layer"].items(), key=lambda kv: kv[1])
        m.update(knn=value, knn_layer=layer, knn_last=list(probe["knn_per_layer"].values())[-1])
    if "position_probe" in probe:
        m["position_probe"] = probe["position_probe"]["top1"]
    if "mp3_position_accuracy" in probe:
        m["mp3_eta_curve"] = probe["mp3_position_accuracy"]
        eta = next((float(o.split("=")[1]) for o in run.objective if o.startswith("objective.eta=")), 0.5)
        m["position_accuracy"] = probe["mp3_position_accuracy"][str(eta)]["top1"]
    if "droppos_grid" in probe:
        m["droppos_grid"] = probe["droppos_grid"]
        m["position_accuracy"] = probe["droppos_grid"]["mean"]
    privacy = (read_json(d / "privacy" / "results.json") or {}).get("privacy")
    if privacy:
        m["privacy"] = {attack: {s: {k: v[k] for k in ("mse", "psnr", "ssim", "fft2d")} for s, v in settings.items()}
                        for attack, settings in privacy["metrics"].items()}
        m["privacy_setup"] = {k: privacy[k] for k in ("images", "batch_size", "ratio", "attacks", "unknown_pe_given")}
        m["privacy_setup"]["steps"] = privacy["attack"]["steps"]
    if ort:
        m["top1_ort"] = ort["accuracy"]["top1"]
        if "robustness" in ort:
            m["corruption_errors"] = {k: v["error"] for k, v in ort["robustness"]["errors"].items()}
            m["mean_corruption_error"] = ort["robustness"]["mean_error"]
            m["corruptions_failed"] = sorted(ort["robustness"]["failed"])
    return m


def add_mce(rows: dict[str, list[dict[str, Any]]]) -> None:
    """mCE (ImageNet-C): mean over corruptions of error / the supervised run's error, seed by seed."""
    reference = {m["seed"]: m.get("corruption_errors") for m in rows.get("supervised", [])}
    for metrics in rows.values():
        for m in metrics:
            ref = reference.get(m["seed"])
            if ref and "corruption_errors" in m:
                m["mce"] = statistics.mean(e / ref[k] for k, e in m["corruption_errors"].items() if ref.get(k))


# Fields that change a run's numbers: an earlier results/study.json is reused only when all of them match.
BUDGET_FIELDS = ("preset", "pretrain_epochs", "finetune_epochs", "probe_only", "batch_size", "finetune_overrides",
                 "probe_train_samples", "probe_val_samples", "probe_epochs", "curve_samples",
                 "ort_consistency_samples", "robustness_samples", "speech_pretrain_epochs", "speech_finetune_epochs",
                 "test_samples", "overrides", "speech_overrides")


def earlier_results(cfg: StudyConfig) -> dict[str, list[dict[str, Any]]]:
    """Rows of an earlier ``results/study.json`` measured at this budget (another machine, or a ``runs/`` since
    cleaned): seeds accumulate across study invocations. A different budget is ignored, with a note."""
    path = Path(cfg.results) / "study.json"
    earlier = read_json(path)
    if not earlier:
        return {}
    changed = budget_changes(earlier, cfg)
    if changed:
        print(f"[study] {path}: measured at another budget ({', '.join(changed)} differ); not reused")
        return {}
    rows = earlier.get("results", {})
    for metrics in rows.values():
        for m in metrics:
            m.pop("mce", None)  # recomputed against the supervised rows of the merged table
            m.setdefault("source", str(path))
    return rows


# Version of the training / evaluation harness behind the numbers: rows measured by another version are never
# merged. 1: before issue 16 (layer decay ignored, weight decay on PEs / tokens, probes of an untrained class token,
# Diff. Norm of token 0); 2: optimizer on the backbone's groups with layer decay applied, probes of the trained
# feature, one Diff. Norm (the head's input).
HARNESS_VERSION = 2


def budget_changes(earlier: dict[str, Any], cfg: StudyConfig) -> list[str]:
    """The BUDGET_FIELDS in which an earlier ``study.json`` differs from ``cfg`` (and ``harness`` when it was
    measured by another harness version)."""
    now = asdict(cfg)
    changed = [k for k in BUDGET_FIELDS if _normal(earlier.get("config", {}).get(k)) != _normal(now[k])]
    return changed + (["harness"] if earlier and earlier.get("harness", 1) != HARNESS_VERSION else [])


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def collect(study: Study) -> dict[str, list[dict[str, Any]]]:
    """Every (run, seed) measured below ``runs/`` (configured seeds), plus the earlier rows of ``study.json`` at
    the same budget that are not measured here; ordered by seed."""
    earlier = earlier_results(study.cfg)
    rows = {}
    for run in RUNS:
        found = {m["seed"]: m for m in earlier.get(run.name, [])}
        found.update({s: m for s in study.seeds(run) if (m := metrics_of(study, run, s)) is not None})
        if found:
            rows[run.name] = [found[s] for s in sorted(found)]
    add_mce(rows)
    return rows


def stat(metrics: list[dict[str, Any]], key: str, pct: bool = True) -> str:
    values = [m[key] for m in metrics if m.get(key) is not None]
    if not values:
        return "-"
    scale, digits = (100, 1) if pct else (1, 2)
    mean = statistics.mean(values) * scale
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"


def mean_of(rows: dict[str, list[dict[str, Any]]], name: str, key: str) -> float | None:
    values = [m[key] for m in rows.get(name, []) if m.get(key) is not None]
    return statistics.mean(values) if values else None


def seeds_of(metrics: list[dict[str, Any]]) -> str:
    return ",".join(str(m["seed"]) for m in metrics)


Value = Callable[[dict[str, Any]], float | None]


def per_seed(rows: dict[str, list[dict[str, Any]]], name: str, value: Value | str) -> dict[int, float]:
    """{seed: value} of one run; ``value`` is a metric key or a function of a seed's metrics."""
    get = (lambda m: m.get(value)) if isinstance(value, str) else value
    return {m["seed"]: v for m in rows.get(name, []) if (v := get(m)) is not None}


PRIVACY_RUNS = [r.name for r in RUNS if r.privacy]
PRIVACY_METRICS = (("MSE", "mse", 4), ("PSNR dB", "psnr", 2), ("SSIM", "ssim", 3), ("FFT2D", "fft2d", 3))


def privacy_metric(attack: str, setting: str, key: str) -> Value:
    """A seed's privacy ``key`` (mse / psnr / ssim / fft2d) for one attack and Table 5 setting, or None."""
    return lambda m: m.get("privacy", {}).get(attack, {}).get(setting, {}).get(key)


def privacy_table(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """MJP Table 5 in miniature: (a) attack the update on x, compare with x; (b) on x~, compare with x~; (c) that
    reconstruction vs x. Less privacy = lower MSE, higher PSNR / SSIM / FFT2D."""
    labels = {r.name: r.label for r in RUNS}
    lines = ["| model | seeds | attack | setting | " + " | ".join(h for h, _, _ in PRIVACY_METRICS) + " |",
             "|" + " --- |" * (4 + len(PRIVACY_METRICS))]
    for name in PRIVACY_RUNS:
        measured = [m for m in rows.get(name, []) if "privacy" in m]
        if not measured:
            lines.append(f"| {labels[name]} | not run |" + " - |" * (2 + len(PRIVACY_METRICS)))
            continue
        for attack in ("analytic", "gradient_matching", "random"):
            for setting in ("a", "b", "c"):
                cells = []
                for _, key, digits in PRIVACY_METRICS:
                    values = list(per_seed(rows, name, privacy_metric(attack, setting, key)).values())
                    if not values:
                        break
                    mean = statistics.mean(values)
                    cells.append(f"{mean:.{digits}f}" + (f" ± {statistics.stdev(values):.{digits}f}"
                                                         if len(values) > 1 else ""))
                if cells:
                    lines.append(f"| {labels[name]} | {seeds_of(measured)} | {attack.replace('_', ' ')} | "
                                 f"({setting}) | " + " | ".join(cells) + " |")
    return lines


def table(rows: dict[str, list[dict[str, Any]]], names: list[str], columns: list[tuple[str, str, bool]],
          first: str = "run") -> list[str]:
    """Markdown table: one row per run present, columns (header, metric key, as percent)."""
    labels = {r.name: r.label for r in RUNS}
    lines = ["| " + " | ".join([first, "seeds", *(h for h, _, _ in columns)]) + " |",
             "|" + " --- |" * (len(columns) + 2)]
    for name in names:
        if name in rows:
            cells = [stat(rows[name], k, pct) if k not in ("finetune_pe",) else rows[name][0][k]
                     for _, k, pct in columns]
            lines.append("| " + " | ".join([labels[name], seeds_of(rows[name]), *cells]) + " |")
        elif any(r.name == name for r in RUNS):
            lines.append(f"| {labels[name]} | not run | " + " | ".join("-" for _ in columns) + " |")
    return lines


def paired_delta(ours: dict[int, float], other: dict[int, float]) -> tuple[float, float, str] | None:
    """Mean and spread (std over seeds) of ours - other on the seeds both have, and which seeds; without a shared
    seed, the difference of the means (spread 0, marked unpaired). None when either side is missing."""
    if not ours or not other:
        return None
    seeds = sorted(ours.keys() & other.keys())
    if not seeds:
        delta = statistics.mean(ours.values()) - statistics.mean(other.values())
        return delta, 0.0, "unpaired seeds"
    deltas = [ours[s] - other[s] for s in seeds]
    spread = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
    return statistics.mean(deltas), spread, ("seed " if len(seeds) == 1 else "seeds ") + ",".join(map(str, seeds))


def _delta_text(delta: float, spread: float, seeds: str, scale: float, unit: str) -> str:
    pm = f" ± {spread * scale:.1f}" if spread else ""
    return f"{delta * scale:+.1f}{pm} {unit}, {seeds}"


def verdict(ours: dict[int, float], other: dict[int, float], paper_says_higher: bool, noise: float = 0.005,
            scale: float = 100, unit: str = "pt") -> str:
    """Our seed-paired difference against the paper's direction. A tie when it is within +-noise, or within the
    spread of the per-seed differences (too close to call at this budget)."""
    got = paired_delta(ours, other)
    if got is None:
        return "not run"
    delta, spread, seeds = got
    text = _delta_text(delta, spread, seeds, scale, unit)
    if abs(delta) <= max(noise, spread):
        return f"tie ({text})"
    return f"{'agrees' if (delta > 0) == paper_says_higher else '**contradicts**'} ({text})"


def on_par(ours: dict[int, float], other: dict[int, float], tolerance: float = 0.01) -> str:
    """A claim that two numbers match: agrees when the seed-paired difference is within +-tolerance."""
    got = paired_delta(ours, other)
    if got is None:
        return "not run"
    delta, spread, seeds = got
    word = "agrees" if abs(delta) <= tolerance else "**contradicts**"
    return f"{word} ({_delta_text(delta, spread, seeds, 100, 'pt')})"


def claims(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each paper's claim beside what this study measured, paired by seed (see :func:`verdict`)."""
    def m(name: str, key: Value | str) -> dict[int, float]:
        return per_seed(rows, name, key)

    def comparable(a: str, b: str) -> tuple[dict[int, float], dict[int, float]]:
        """Fine-tuned top-1 of both runs, else their linear probes."""
        for key in ("top1", "linear_probe"):
            if m(a, key) and m(b, key):
                return m(a, key), m(b, key)
        return {}, {}

    def eta_curve(eta: str) -> Value:
        return lambda r: r.get("mp3_eta_curve", {}).get(eta, {}).get("top1")

    def psnr(attack: str, setting: str) -> Value:
        return privacy_metric(attack, setting, "psnr")

    def psnr_verdict(ours: dict[int, float], other: dict[int, float], paper_says_higher: bool) -> str:
        return verdict(ours, other, paper_says_higher, noise=1.0, scale=1, unit="dB PSNR")

    items = [
        ("MP3 Table 3: MP3 pretraining + fine-tuning beats supervised training of the same ViT",
         verdict(m("mp3", "top1"), m("supervised", "top1"), True)),
        ("MP3 Table 3: with MP3 pretraining, 2D relative PE is on par with absolute (84.2 vs 84.0)",
         on_par(m("mp3_ft_relbias2d", "top1"), m("mp3", "top1"))),
        ("MP3 Table 3: MP3 without any PE stays far above supervised without PE (82.6 vs 64.6)",
         verdict(m("mp3_ft_none", "top1"), m("supervised_nope", "top1"), True)),
        ("MP3 Fig. 3: position accuracy falls as the evaluation eta grows (eval 0.9 vs 0, train eta 0.5)",
         verdict(m("mp3", eta_curve("0.9")), m("mp3", eta_curve("0.0")), False)),
        ("MP3 Fig. 3: a model trained with eta 0.75 predicts positions better at eval eta 0.75 than one trained "
         "with eta 0", verdict(m("mp3_eta0.75", eta_curve("0.75")), m("mp3_eta0", eta_curve("0.75")), True)),
        ("MP3 Fig. 6: an intermediate eta (0.5) fine-tunes better than eta 0 (here: fine-tuned top-1, or the linear "
         "probe when the eta runs were probed only)", verdict(*comparable("mp3", "mp3_eta0"), True)),
        ("DropPos Table 1: gamma 0.75 fine-tunes better than gamma 0.5",
         verdict(m("droppos", "top1"), m("droppos_gamma0.5", "top1"), True)),
        ("DropPos Table 3: sigma = 0 predicts positions better but fine-tunes worse than sigma 1 -> 0 (position)",
         verdict(m("droppos_sigma0", "position_accuracy"), m("droppos", "position_accuracy"), True)),
        ("DropPos Table 3: ... (fine-tune)", verdict(m("droppos_sigma0", "top1"), m("droppos", "top1"), False)),
        ("DropPos Table 4: tau = inf fine-tunes worse than tau 0.1",
         verdict(m("droppos_tau_inf", "top1"), m("droppos", "top1"), False)),
        ("StoP Table 1: StoP beats I-JEPA in linear probing (100% of the labels)",
         verdict(m("stop", "linear_probe"), m("ijepa", "linear_probe"), True)),
        ("StoP Table 6: ... and with 1% of the labels",
         verdict(m("stop", "linear_probe_1pct"), m("ijepa", "linear_probe_1pct"), True)),
        ("MJP Table 1: MJP is more consistent under a gamma 0.15 jigsaw than the supervised ViT",
         verdict(m("mjp", "consistency"), m("supervised", "consistency"), True)),
        ("MJP Table 3: larger training gamma -> higher consistency (0.27 vs 0.03)",
         verdict(m("mjp_gamma0.27", "consistency"), m("mjp_gamma0.03", "consistency"), True)),
        ("MJP Table 3: top-1 stays flat across training gamma (0.27 vs 0.03, within 1 pt)",
         on_par(m("mjp_gamma0.27", "top1"), m("mjp_gamma0.03", "top1"))),
        ("MJP Table 5: APRIL recovers less from MJP's update on x~ (b) than from the supervised ViT's on x (a)",
         psnr_verdict(m("mjp_gamma0.27", psnr("analytic", "b")),
                      m("supervised", psnr("analytic", "a")), False)),
        ("MJP Table 5: ... and MJP's reconstruction is further still from the original x (c vs b)",
         psnr_verdict(m("mjp_gamma0.27", psnr("analytic", "c")),
                      m("mjp_gamma0.27", psnr("analytic", "b")), False)),
        ("MJP Table 5: a ViT without PE leaks more than MJP (setting a; gradient matching, the attack that applies "
         "to both)", psnr_verdict(m("supervised_nope", psnr("gradient_matching", "a")),
                                  m("mjp_gamma0.27", psnr("gradient_matching", "a")), True)),
        ("RandSAC Table 2: random serialization beats raster order (linear probe)",
         verdict(m("randsac_patch_random", "linear_probe"), m("randsac_raster", "linear_probe"), True)),
        ("RandSAC Table 5: segments (blob) beat patch-random (linear probe)",
         verdict(m("randsac_blob_flat", "linear_probe"), m("randsac_patch_random", "linear_probe"), True)),
        ("RandSAC Table 7: hierarchical blobs (11 -> 5) beat flat blobs (linear probe)",
         verdict(m("randsac", "linear_probe"), m("randsac_blob_flat", "linear_probe"), True)),
        ("MP3 Table 5: MP3 pretraining improves the keyword-spotting Transformer",
         verdict(m("speech_mp3", "top1"), m("speech_supervised", "top1"), True)),
    ]
    lines = ["| claim (paper) | this study |", "| --- | --- |"]
    return lines + [f"| {c} | {v} |" for c, v in items]


def plots(rows: dict[str, list[dict[str, Any]]], out: Path) -> list[str]:
    """PNG figures; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, written = {r.name: r.label for r in RUNS}, []
    main = [r.name for r in RUNS if r.group == "main" and r.name in rows]
    if main:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        x = range(len(main))
        bars = (("top1", "fine-tuned top-1"), ("linear_probe", "linear probe"), ("knn", "kNN (best layer)"))
        for offset, (key, name) in zip((-0.2, 0.0, 0.2), bars, strict=True):
            ax.bar([i + offset for i in x], [mean_of(rows, n, key) or 0 for n in main], width=0.2, label=name)
        ax.set_xticks(list(x), [labels[n] for n in main], rotation=20)
        ax.set(ylabel="Fashion-MNIST test accuracy", ylim=(0, 1), title="same ViT, same data, same total epochs")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "study_main.png", dpi=120)
        plt.close(fig)
        written.append("study_main.png")
    curves = {n: rows[n][0]["mp3_eta_curve"] for n in ("mp3_eta0", "mp3", "mp3_eta0.75")
              if n in rows and "mp3_eta_curve" in rows[n][0]}
    if curves:
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        for n, curve in curves.items():
            etas = sorted(curve, key=float)
            ax.plot([float(e) for e in etas], [curve[e]["top1"] for e in etas], marker="o",
                    label={"mp3": "train eta 0.5"}.get(n, n.replace("mp3_eta", "train eta ")))
        ax.set(xlabel="evaluation eta", ylabel="position top-1", title="MP3 position accuracy (Fig. 3)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "study_mp3_eta.png", dpi=120)
        plt.close(fig)
        written.append("study_mp3_eta.png")
    mjp = [n for n in ("supervised", "mjp_gamma0", "mjp_gamma0.03", "mjp", "mjp_gamma0.27") if n in rows]
    if mjp:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
        for n in mjp:
            curve = rows[n][0].get("consistency_curve", {})
            gammas = sorted(curve, key=float)
            label = {"mjp": "MJP gamma 0.15"}.get(n, labels[n])
            axes[0].plot([float(g) for g in gammas], [curve[g]["consistency"] for g in gammas], marker="o",
                         label=label)
            axes[1].plot([float(g) for g in gammas], [curve[g]["diff_norm"] for g in gammas], marker="o",
                         label=label)
        axes[0].set(xlabel="evaluation gamma", ylabel="consistency", title="MJP consistency (Fig. 3)")
        axes[1].set(xlabel="evaluation gamma", ylabel="Diff. Norm", title="||F(x) - F(x~)||")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "study_mjp_consistency.png", dpi=120)
        plt.close(fig)
        written.append("study_mjp_consistency.png")
    return written


def privacy_figure(study: Study, out: Path) -> list[str]:
    """MJP Fig. 5 style grid from the privacy stages' ``privacy.npz`` (first seed of each model that has one):
    originals, each model's reconstruction of its update on x (a), the jigsaw x~, each model's reconstruction of
    its update on x~ (b). APRIL where the model has a learned PE, else gradient matching. Kept as is when no run
    directory holds the images (a report from merged results)."""
    import numpy as np

    found = {}
    for run in (r for r in RUNS if r.privacy):
        path = next((p for s in study.seeds(run) if (p := study.dir(run, s) / "privacy" / "privacy.npz").is_file()),
                    None)
        if path is not None:
            found[run.label] = dict(np.load(path))
    if not found:
        return ["study_privacy.png"] if (out / "study_privacy.png").is_file() else []

    def reconstructions(setting: str) -> dict[str, np.ndarray]:
        recs = {}
        for label, arrays in found.items():
            attack = "analytic" if f"analytic_{setting}" in arrays else "gradient_matching"
            recs[f"{label}\n{'APRIL' if attack == 'analytic' else 'grad. matching'}"] = arrays[f"{attack}_{setting}"]
        return recs

    first = next(iter(found.values()))
    evaluate.plot_privacy_grid(first["originals"], first["shuffled"], reconstructions("a"), reconstructions("b"),
                               out / "study_privacy.png",
                               "gradient inversion of one-image updates (MJP Table 5 settings (a), (b); Fig. 5)")
    return ["study_privacy.png"]


MAIN_COLUMNS = [("pretrain ep", "pretrain_epochs", False), ("fine-tune ep", "finetune_epochs", False),
                ("wall-clock min", "minutes", False), ("fine-tune PE", "finetune_pe", False),
                ("top-1", "top1", True), ("top-1 ORT", "top1_ort", True), ("linear probe", "linear_probe", True),
                ("linear 1%", "linear_probe_1pct", True), ("kNN (best layer)", "knn", True),
                ("consistency@0.15", "consistency", True), ("Diff. Norm@0.15", "diff_norm", False),
                ("mCE", "mce", False), ("position acc.", "position_accuracy", True),
                ("position probe", "position_probe", True)]


def markdown(cfg: StudyConfig, rows: dict[str, list[dict[str, Any]]], figures: list[str], hardware: str) -> str:
    names = [r.name for r in RUNS]
    group = {g: [r.name for r in RUNS if r.group == g] for g in GROUPS}
    lines = ["# Reproduction study (laptop scale)", "", f"Hardware: {hardware}", "",
             f"Fashion-MNIST padded to 32 px, patch 4 (64 positions); backbone `{cfg.preset}` for every image run; "
             f"pretraining {cfg.pretrain_epochs} epoch(s) + fine-tuning {cfg.finetune_epochs} epoch(s) "
             f"(supervised and MJP: {cfg.pretrain_epochs + cfg.finetune_epochs} from scratch); fine-tuning recipe "
             f"`finetune_fashion_mnist.yaml` + {list(cfg.finetune_overrides)}. Accuracies in %, on "
             f"{cfg.test_samples or 'the 10,000'} test images (top-1), "
             f"probes on {cfg.probe_train_samples} train / {cfg.probe_val_samples} test images, "
             f"curves on {cfg.curve_samples}; mCE over the corruptions that ran, normalized by the supervised run "
             "(= 1.00). `mean ± std` where several seeds ran. Wall-clock: pretraining + fine-tuning minutes with "
             "the study's processes sharing the machine. Command and config: `study.json`.", "",
             "## Every method", ""]
    lines += table(rows, group["main"], MAIN_COLUMNS, "method")
    lines += ["", "position acc.: MP3 top-1 at the training eta, DropPos mean of its 4 x 4 grid; position probe: a "
              "linear probe of the patch tokens' positions (DropPos Table 7), for every backbone.", "",
              "## What the papers claim, and what this study measured", "", *claims(rows)]
    lines += ["", "## MP3: fine-tuning PE (Table 3) and masking ratio (Figs. 3, 6)", ""]
    lines += table(rows, ["mp3", *group["mp3_pe"], "supervised", "mp3_eta0", "mp3_eta0.75"],
                   [("fine-tune PE", "finetune_pe", False), ("top-1", "top1", True),
                    ("linear probe", "linear_probe", True), ("position acc. (train eta)", "position_accuracy", True),
                    ("consistency@0.15", "consistency", True)])
    curves = {n: rows[n][0]["mp3_eta_curve"] for n in ("mp3_eta0", "mp3", "mp3_eta0.75")
              if n in rows and "mp3_eta_curve" in rows[n][0]}
    if curves:
        etas = sorted(next(iter(curves.values())), key=float)
        lines += ["", "MP3 position top-1 vs evaluation eta (Fig. 3):", "",
                  "| train eta | " + " | ".join(f"eval {e}" for e in etas) + " |", "|" + " --- |" * (len(etas) + 1)]
        lines += [f"| {({'mp3': '0.5'}).get(n, n.removeprefix('mp3_eta'))} | "
                  + " | ".join(f"{c[e]['top1'] * 100:.1f}" for e in etas) + " |" for n, c in curves.items()]
    lines += ["", "## DropPos: gamma (Table 1), sigma (Table 3), tau (Table 4)", ""]
    lines += table(rows, ["droppos", *group["droppos"]], [("top-1", "top1", True),
                                                         ("linear probe", "linear_probe", True),
                                                         ("position acc. (grid mean)", "position_accuracy", True)])
    if "droppos" in rows and "droppos_grid" in rows["droppos"][0]:
        grid = rows["droppos"][0]["droppos_grid"]
        cells = {tuple(float(p.split("=")[1]) for p in k.split(",")): v for k, v in grid.items() if k != "mean"}
        gammas, gposes = sorted({g for g, _ in cells}), sorted({p for _, p in cells})
        lines += ["", "DropPos position accuracy grid of the main run (rows gamma, columns gamma_pos):", "",
                  "| gamma \\ gamma_pos | " + " | ".join(str(p) for p in gposes) + " |",
                  "|" + " --- |" * (len(gposes) + 1)]
        lines += [f"| {g} | " + " | ".join(f"{cells[(g, p)] * 100:.1f}" for p in gposes) + " |" for g in gammas]
    lines += ["", "## StoP vs I-JEPA (sigma = 0): linear probe with 100% and 1% of the labels (Tables 1, 6)", ""]
    lines += table(rows, ["ijepa", "stop"], [("linear probe 100%", "linear_probe", True),
                                             ("linear probe 1%", "linear_probe_1pct", True),
                                             ("kNN", "knn", True), ("fine-tuned top-1", "top1", True)])
    lines += ["", "## MJP: training gamma (Table 3) and consistency vs evaluation gamma (Fig. 3)", ""]
    lines += table(rows, ["supervised", "mjp_gamma0", "mjp_gamma0.03", "mjp", "mjp_gamma0.27"],
                   [("top-1", "top1", True), ("consistency@0.15", "consistency", True),
                    ("Diff. Norm@0.15", "diff_norm", False)])
    setup = next((m["privacy_setup"] for n in PRIVACY_RUNS for m in rows.get(n, []) if "privacy_setup" in m), None)
    if setup:
        lines += ["", "## MJP: gradient inversion (Table 5, Fig. 5)", "",
                  f"One test image per class ({setup['images']} images), one image per client update, jigsaw "
                  f"gamma {setup['ratio']} for (b) / (c). Attacks: APRIL's closed form (MJP App. G Eq. 9; needs a "
                  f"learned PE) and gradient matching (cosine distance + TV, Adam, {setup['steps']} steps, known "
                  "labels); `random` scores uniform noise against the same targets. The supervised ViT and the ViT "
                  "without PE see x~ without an unknown PE (they were not trained with one); MJP gets its unknown "
                  "PE on the shuffled positions, as in training. Privacy is better with higher MSE and lower PSNR, "
                  "SSIM and FFT2D (cosine similarity of the |FFT2| spectra).", ""]
        lines += privacy_table(rows)
    lines += ["", "## RandSAC: serialization and segments (Tables 2, 5, 7)", ""]
    lines += table(rows, ["randsac_raster", "randsac_patch_random", "randsac_square", "randsac_blob_flat", "randsac"],
                   [("linear probe", "linear_probe", True), ("kNN", "knn", True), ("fine-tuned top-1", "top1", True)])
    lines += ["", "## Speech: keyword spotting, 12 classes, ~70K-parameter Transformer (MP3 Table 5)", ""]
    lines += table(rows, group["speech"], [("pretrain ep", "pretrain_epochs", False),
                                           ("fine-tune ep", "finetune_epochs", False), ("test top-1", "top1", True),
                                           ("linear probe", "linear_probe", True)])
    failed = sorted({f for ms in rows.values() for m in ms for f in m.get("corruptions_failed", [])})
    if failed:
        lines += ["", f"Corruptions that failed in this environment (not in mCE): {', '.join(failed)}."]
    lines += [""] + [f"![{f}]({f})" for f in figures]
    missing = [n for n in names if n not in rows]
    if missing:
        lines += ["", f"Not run (yet): {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def commands_so_far(cfg: StudyConfig, argv: list[str]) -> list[str]:
    """The study commands whose rows the report holds: those of an earlier ``study.json`` at this budget, then this
    one (``--report-only`` measures nothing and is not recorded)."""
    earlier = read_json(Path(cfg.results) / "study.json") or {}
    commands = [] if budget_changes(earlier, cfg) else list(earlier.get("commands", []))
    if "--report-only" not in argv:
        command = "python pipelines/study.py " + " ".join(argv)
        commands = [c for c in commands if c != command] + [command]
    return commands


def report(cfg: StudyConfig, argv: list[str]) -> str:
    study = Study(cfg)
    out = Path(cfg.results)
    out.mkdir(parents=True, exist_ok=True)
    rows = collect(study)
    figures = plots(rows, out) + privacy_figure(study, out)
    hardware = hardware_line()
    text = markdown(cfg, rows, figures, hardware)
    payload = {"harness": HARNESS_VERSION, "commands": commands_so_far(cfg, argv), "config": asdict(cfg),
               "hardware": hardware, "python": platform.python_version(), "torch": torch.__version__,
               "runs": {r.name: {"group": r.group, "label": r.label, "config": r.config,
                                 "objective": list(r.objective), "finetune_pe": r.finetune_pe,
                                 "pretrain_from": r.pretrain_from} for r in RUNS},
               "results": rows}
    write_json_atomic(out / "study.json", payload)  # two study processes may finish at once
    with atomic_file(out / "study.md") as tmp:
        tmp.write_text(text)
    return text


# relative cost of each group at the default budget (training epochs + evaluations), to balance --jobs
GROUP_COST = {"main": 9.0, "mp3_pe": 3.0, "mp3_eta": 2.0, "droppos": 4.0, "mjp": 2.5, "randsac": 2.5, "speech": 0.5}


def split_groups(groups: tuple[str, ...], jobs: int) -> list[list[str]]:
    """Greedy longest-first split of the groups over ``jobs`` processes; mp3_pe rides with main (it fine-tunes the
    main MP3 pretraining) and comes after it."""
    units = [[g] for g in groups if g != "mp3_pe"]
    if "mp3_pe" in groups:
        host = next((u for u in units if u == ["main"]), None)
        host.append("mp3_pe") if host is not None else units.append(["mp3_pe"])
    buckets: list[list[str]] = [[] for _ in range(min(jobs, len(units)))]
    for unit in sorted(units, key=lambda u: -sum(GROUP_COST[g] for g in u)):
        min(buckets, key=lambda b: sum(GROUP_COST[g] for g in b)).extend(unit)
    return [sorted(b, key=lambda g: (groups.index(g) if g != "mp3_pe" else groups.index("main") + 0.5))
            for b in buckets if b]  # each process keeps the priority order of ``groups``


def run_jobs(args: argparse.Namespace, cfg: StudyConfig) -> int:
    """Run the groups as ``args.jobs`` study processes (each with cpu_count / jobs torch threads); logs in runs/."""
    import subprocess

    threads = cfg.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    base = [sys.executable, __file__, *(["--config", args.config] if args.config else []), *args.overrides]
    logs, procs = [], []
    Path(cfg.runs).mkdir(parents=True, exist_ok=True)
    for i, groups in enumerate(split_groups(cfg.groups, args.jobs)):
        log = Path(cfg.runs) / f"job{i}.log"
        print(f"[study] job {i}: groups {groups}, {threads} thread(s), log {log}", flush=True)
        with log.open("a") as f:
            procs.append(subprocess.Popen([*base, f"groups=[{','.join(groups)}]", f"threads={threads}"],
                                          stdout=f, stderr=subprocess.STDOUT))
        logs.append(log)
    codes = [proc.wait() for proc in procs]
    failed = [str(log) for log, code in zip(logs, codes, strict=True) if code != 0]
    if failed:
        print(f"error: study job(s) failed, see {', '.join(failed)}; run the same command again (it resumes)",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="config fields (override with field=value):\n" + "\n".join(
                                         describe(StudyConfig)))
    parser.add_argument("--config", help="YAML file (pipelines/configs/study_fashion_mnist.yaml)")
    parser.add_argument("--report-only", action="store_true", help="only (re)write the results from finished runs")
    parser.add_argument("--jobs", type=int, default=1, help="study processes sharing the groups (default: 1)")
    parser.add_argument("overrides", nargs="*", help="field=value, e.g. seeds=[0,1,2] groups=[main]")
    args = parser.parse_args(argv)
    try:
        cfg = load(StudyConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if args.jobs > 1 and not args.report_only:
        if run_jobs(args, cfg) != 0:
            return 1
    elif not args.report_only:
        try:
            Study(cfg).run_all()
        except StageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(report(cfg, argv))
    print(f"[study] results: {cfg.results}/study.md, study.json and PNGs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
