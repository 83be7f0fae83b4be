"""Evaluate a checkpoint with PyTorch: classification, frozen-feature probes and each method's own curves.

    python pipelines/evaluate.py --config pipelines/configs/evaluate_fashion_mnist.yaml \\
        model.checkpoint=runs/x/checkpoint
    # + MJP's gradient inversion (--privacy):
    python pipelines/evaluate.py --privacy --config pipelines/configs/evaluate_fashion_mnist.yaml \\
        model.checkpoint=runs/x/checkpoint privacy.images=10 privacy.steps=200

Reports (``results.json`` + ``report.md`` + PNGs in ``run.output``): top-1 / top-5 / confusion matrix when the
checkpoint has a head; linear probe and layer-wise kNN probe (MP3 App. C) on frozen features; position probe
(DropPos Table 7); MJP consistency and Diff. Norm over the eval jigsaw ratios (MJP Table 1 / Fig. 3) for
classifiers; MP3 position accuracy vs eta (Fig. 3) + a reassembled image (Fig. 2) and the DropPos 4 x 4 position
grid when the checkpoint holds those objectives. ``--privacy`` (= ``privacy.enabled=true``) adds MJP's
gradient-inversion evaluation (Table 5 settings (a) / (b) / (c), APRIL analytic + gradient-matching attacks; MSE,
PSNR, SSIM, FFT2D; ``privacy.png`` of originals vs reconstructions, Fig. 5) on one test image per class.

Refused in one line, before anything is computed: a ``run.output`` holding an earlier evaluation's results (unless
``run.overwrite=true``, which replaces them), images the checkpoint trained on (``data.val`` = its training split,
or ``data.val=holdout`` outside the hold-out it records), a classifier on data whose classes (names, order) are not
its own, and inputs the model cannot take. Every split is normalized with the checkpoint's training statistics.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors.torch import load_file

from patchplace.data.atomic import atomic_file
from patchplace.data.manifest import class_list, first_difference
from patchplace.data.memory import MemoryReader, balanced_subset
from patchplace.finetune import (
    AttackConfig,
    PrivacyError,
    consistency_curve,
    extract_features,
    knn_probe_per_layer,
    position_probe,
    privacy_settings,
    probe_feature_of,
    subsample_per_class,
    torch_predict,
)
from patchplace.models import ModelError, load_pretrained
from patchplace.models.hub import check_finite
from patchplace.objectives import (
    MP3,
    DropPos,
    MethodSpec,
    get_method,
    jigsaw,
    method_names,
    position_accuracy_grid,
    position_accuracy_vs_eta,
    reassemble,
)
from patchplace.pipelines.config import (
    HOLDOUT,
    MAX_SEED,
    ConfigError,
    DataSection,
    ModelSection,
    RunSection,
    load,
    one_line,
    parser,
)
from patchplace.pipelines.engine import USER_ERRORS, Data, check_inputs, classify, holdout_indices, start
from patchplace.pipelines.evaluation import first_images, plot_privacy_grid, probe


@dataclass
class EvalSection:
    """What to compute (each can be switched off) and with how much data."""

    linear_probe: bool = True  # linear classifier on frozen features (MAE protocol), 100% and low-label
    knn: bool = True  # kNN top-1 per layer (MP3 App. C)
    position_probe: bool = True  # linear probe of each patch token's position (DropPos Table 7)
    consistency_ratios: tuple[float, ...] = (0.03, 0.09, 0.15, 0.27, 0.5)  # MJP eval gammas (classifiers)
    probe_train_samples: int = 5000  # train samples used for the probes' features
    probe_epochs: int = 100  # epochs of each linear probe
    low_label_fraction: float = 0.01  # a second linear probe on this fraction of the probe's labels (StoP: 1%)
    # linear probes trained on these class-balanced fractions of the *whole* data.train (the label-efficiency
    # protocol: the same subsets as fine-tuning with data.label_fraction, picked by data.label_subset_seed)
    label_fractions: tuple[float, ...] = ()
    max_eval_samples: int = 2000  # images for the method curves (eta curve, DropPos grid, consistency)

    def validate(self) -> None:
        if any(not 0 < f <= 1 for f in self.label_fractions):
            raise ConfigError(f"eval.label_fractions must be in (0, 1] (e.g. [0.01, 0.1]), got "
                              f"{list(self.label_fractions)}")


@dataclass
class PrivacySection(AttackConfig):
    """Gradient-inversion privacy evaluation (MJP §5.4, Table 5): which images and settings, plus the
    gradient-matching attack's own fields (``AttackConfig``: steps, lr, distance, tv_weight, optimizer, ...)."""

    enabled: bool = False  # also --privacy
    images: int = 10  # one test image per class (first occurrences), up to this many (the paper: one per class)
    batch_size: int = 1  # images per client update; the APRIL analytic attack needs 1
    ratio: float = 0.27  # masked-jigsaw gamma of settings (b) / (c) (Table 5 uses MJP with gamma = 0.27)
    analytic: bool = True  # APRIL's closed form, for models with a learnable PE
    steps: int = 200  # gradient-matching attack (a CPU budget)
    tv_weight: float = 1e-4  # total-variation prior of the gradient-matching attack

    def attack(self) -> AttackConfig:
        return AttackConfig(**{f.name: getattr(self, f.name) for f in fields(AttackConfig)})

    def validate(self) -> None:
        try:
            self.attack().validate()
        except PrivacyError as exc:
            raise ConfigError(f"privacy: {exc}") from None
        if self.images < 1 or self.batch_size < 1 or not 0 < self.ratio < 1:
            raise ConfigError("privacy.images and privacy.batch_size must be >= 1 and privacy.ratio in (0, 1)")


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


@dataclass
class EvalModelSection:
    """The checkpoint evaluated; it brings its architecture (no preset, no overrides)."""

    checkpoint: str | None = None  # required: the checkpoint/ (or best/) directory of a pretrain or finetune run
    attention: str = "sdpa"  # attention kernel: sdpa | math (the materialised softmax); the same numbers either way

    def validate(self) -> None:
        ModelSection.validate(self)  # model.attention, as for training


@dataclass
class EvalRunSection:
    """Where the results go, and the seed. Evaluation runs in full precision, without gradient accumulation or
    TensorBoard: the class values below stand in for training's fields of the Accelerator."""

    output: str = "runs/evaluate"  # results.json, report.md and the plots
    seed: int = 0  # every RNG (random, numpy, torch) and the data readers start from it
    overwrite: bool = False  # replace the results of an earlier evaluation in run.output (without it: refused)
    mixed_precision: ClassVar[str] = "no"
    grad_accum: ClassVar[int] = 1
    tensorboard: ClassVar[bool] = False

    def validate(self) -> None:
        if not 0 <= self.seed < MAX_SEED:
            raise ConfigError(f"run.seed must be in [0, 2**31), got {self.seed}")


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

    def validate(self) -> None:
        if not self.model.checkpoint:
            raise ConfigError("model.checkpoint is required: the checkpoint/ directory of a pretrain or finetune run")


# what an evaluation writes in run.output (run.overwrite=true replaces an earlier one's)
RESULT_FILES = ("results.json", "report.md", "evaluation.png", "mp3_position_accuracy.png", "mp3_reassembled.png",
                "privacy.png", "privacy.npz")


def objective_state(extras: Path) -> dict[str, torch.Tensor]:
    """The saved objective's parameters (``objective.safetensors``), refused in one line when unreadable or not
    finite."""
    try:
        state = load_file(str(extras))
    except Exception as exc:  # SafetensorError (a pickle renamed, a torn file): one line, no code runs
        raise ModelError(f"{extras} is not a readable safetensors file ({' '.join(str(exc).split())[:160]}): "
                         "restore it from the run's checkpoint, or evaluate without the method curves") from None
    check_finite(state, extras)
    return state


def refuse_earlier_results(cfg: EvaluateConfig) -> None:
    """An evaluation never replaces an earlier one's results silently: run.output holding ``results.json`` /
    ``report.md`` is refused (nothing is touched) unless ``run.overwrite=true``."""
    out = Path(cfg.run.output)
    found = [name for name in RESULT_FILES[:2] if (out / name).is_file()]
    if not found or cfg.run.overwrite:
        return
    try:
        earlier = f" of {json.loads((out / 'results.json').read_text())['checkpoint']}"
    except (OSError, ValueError, KeyError, TypeError):
        earlier = ""
    raise ConfigError(f"run.output {out} already holds the results of an evaluation{earlier} ({', '.join(found)}): "
                      "choose another run.output, or replace them with run.overwrite=true")


def trained_on(metadata: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(method, data record) of the checkpoint and of each checkpoint it was fine-tuned from: the splits whose
    images (all but the recorded hold-out) its weights learned from."""
    chain, node = [], metadata
    while isinstance(node, dict):
        if isinstance(node.get("data"), dict):
            chain.append((str(node.get("method") or "?"), node["data"]))
        node = node.get("pretrain_metadata")
    return chain


def check_unseen(cfg: DataSection, data: Data, metadata: dict[str, Any], checkpoint: str) -> None:
    """Refuse to score ``checkpoint`` on images it (or the checkpoint it was fine-tuned from) trained on: data.val
    being the split it trained on, or ``data.val=holdout`` drawing samples outside the hold-out it recorded (its
    size and seed give the same samples again: :func:`~patchplace.pipelines.engine.holdout_indices`)."""
    if cfg.val != HOLDOUT:
        m = data.val.manifest
        fingerprint = m.fingerprint()
        for method, record in trained_on(metadata):
            if record.get("fingerprint") == fingerprint:
                held = record.get("holdout") or {}
                size, seed = held.get("size") or 0, held.get("seed", 0)
                raise ConfigError(
                    f"data.val={cfg.val} is {m.dataset}/{m.split}, the split {checkpoint} ({method}) trained on"
                    + (f" (less its {size} held-out samples)" if size else "") + ": its score would count images it "
                    "learned from; evaluate it on a test split" + (
                        f", or on its hold-out: data.val=holdout data.holdout={size} data.holdout_seed={seed}"
                        if size else ""))
        return
    m, labels = data.manifest, data.train_labels
    chosen = set(holdout_indices(labels, cfg.holdout, cfg.holdout_seed).tolist())
    fingerprint = m.fingerprint()
    for method, record in trained_on(metadata):
        if record.get("fingerprint") != fingerprint:
            continue
        held = record.get("holdout")
        if not isinstance(held, dict):
            raise ConfigError(f"data.val=holdout: {checkpoint} ({method}) was trained on {m.dataset}/{m.split} and "
                              "records no hold-out (written before checkpoints recorded one), so it may have trained "
                              "on these images; evaluate it on a test split (data.val=<split directory>)")
        size, seed = int(held.get("size") or 0), int(held.get("seed") or 0)
        seen = len(chosen - set(holdout_indices(labels, size, seed).tolist()))
        if seen:
            kept = f"data.holdout={size} with data.holdout_seed={seed}" if size else "nothing (data.holdout=0)"
            again = f"data.holdout={size} data.holdout_seed={seed}, or on " if size else ""
            raise ConfigError(f"data.val=holdout (data.holdout={cfg.holdout}, data.holdout_seed={cfg.holdout_seed}): "
                              f"{seen} of its {len(chosen)} images are ones {checkpoint} ({method}) trained on, as it "
                              f"held out {kept} of {m.dataset}/{m.split}; evaluate it on {again}a test split "
                              "(data.val=<split directory>)")


def check_classes(backbone, metadata: dict[str, Any], data: Data, checkpoint: str) -> None:
    """A classifier is scored only on data whose classes (names and order) are its own: label i must mean what its
    output i means."""
    classes, m = metadata.get("classes"), data.manifest
    if not backbone.config.num_classes or backbone.config.num_classes != m.num_classes or not classes:
        return
    if list(classes) != list(m.classes):
        dataset = (metadata.get("data") or {}).get("dataset") or "its training data"
        raise ConfigError(f"{checkpoint} classifies {class_list(classes)} ({dataset}) but {m.dataset}/{m.split} holds "
                          f"{class_list(m.classes)} ({first_difference(classes, m.classes)}): its top-1 would compare "
                          f"unrelated labels; evaluate it on {dataset}, or fine-tune it on this data first")


def preflight(cfg: EvaluateConfig, data: Data, backbone, metadata: dict[str, Any]) -> None:
    """What would stop the evaluation half-way, or make its numbers wrong, checked before anything is computed."""
    checkpoint = cfg.model.checkpoint
    check_inputs(backbone, data, f"model.checkpoint={checkpoint}")
    check_classes(backbone, metadata, data, checkpoint)
    check_unseen(cfg.data, data, metadata, checkpoint)
    m = data.manifest
    if cfg.privacy.enabled and (m.modality != "image" or backbone.config.num_classes != m.num_classes):
        raise ConfigError(f"--privacy needs an image classifier for {m.num_classes} classes; {checkpoint} is not one "
                          "(fine-tune it first)")
    extras = Path(checkpoint) / "objective.safetensors"
    if m.modality == "image" and curve_method(metadata) is not None and extras.is_file():
        objective_state(extras)


def curve_method(metadata: dict[str, Any]) -> MethodSpec | None:
    """The checkpoint's method when its saved objective gives evaluation curves (its registration says so)."""
    method = metadata.get("method")
    if method not in method_names():
        return None
    spec = get_method(method)
    return spec if spec.curves else None


def method_curves(backbone, metadata: dict, checkpoint: Path, images: torch.Tensor, out_dir: Path) -> dict:
    """MP3 eta curve + reassembled picture, or the DropPos grid, from the saved objective parameters (on the
    backbone's device; the images and the picture stay on the CPU)."""
    spec, extras = curve_method(metadata), checkpoint / "objective.safetensors"
    if spec is None or not extras.is_file():
        return {}
    method, objective = spec.name, spec.build(backbone, metadata.get("objective", {}))
    if not isinstance(objective, (MP3, DropPos)):
        raise ModelError(f"evaluate has no curves for {method} ({type(objective).__name__}): register it with "
                         "curves=False")
    state = objective_state(extras)
    missing, unexpected = objective.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("backbone.") for k in missing):
        raise ModelError(f"{extras} does not match the {method} objective")
    device = next(backbone.parameters()).device
    objective, on_device = objective.to(device), images.to(device)
    if isinstance(objective, DropPos):
        grid = position_accuracy_grid(objective, on_device, generator=torch.Generator().manual_seed(0))
        return {"droppos_grid": {("mean" if k == "mean" else f"gamma={k[0]},gamma_pos={k[1]}"): v
                                 for k, v in grid.items()}}
    # 0.55 (where MP3 Fig. 3 puts the train-0.75 peak) last: the masks drawn for the other etas stay the same
    curve = position_accuracy_vs_eta(objective, on_device, etas=(0.0, 0.25, 0.5, 0.75, 0.9, 0.55),
                                     generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = objective.eval().position_logits(on_device[:8], eta=0.0)[0].float().cpu()
    picture = reassemble(images[:8], logits, backbone.config.patch_size)
    plot_mp3(curve, images[:8], picture, out_dir)
    return {"mp3_position_accuracy": {str(k): v for k, v in curve.items()}}


def plot_mp3(curve: dict, images: torch.Tensor, picture, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = sorted(curve)
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(etas, [curve[e]["top1"] for e in etas], marker="o", label="top-1")
    ax.plot(etas, [curve[e]["top5"] for e in etas], marker="o", label="top-5")
    ax.set(xlabel="evaluation masking ratio eta", ylabel="position accuracy", title="MP3 position accuracy (Fig. 3)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "mp3_position_accuracy.png", dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(2, len(images), figsize=(1.2 * len(images), 2.6))
    for i in range(len(images)):
        axes[0, i].imshow(images[i].permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray")
        axes[1, i].imshow(picture[i].squeeze(-1), cmap="gray")
        axes[0, i].axis("off")
        axes[1, i].axis("off")
    fig.suptitle("input (top) and patches placed at predicted positions (bottom), eta = 0")
    fig.tight_layout()
    fig.savefig(out_dir / "mp3_reassembled.png", dpi=120)
    plt.close(fig)


def one_per_class(dataset, n: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first test image of each class, in class order, up to ``n`` (a fixed set: same images for every model)."""
    chosen: dict[int, torch.Tensor] = {}
    for x, y in dataset.batches(batch_size, epoch=0):
        for image, label in zip(x, y.tolist(), strict=True):
            chosen.setdefault(label, image)
        if len(chosen) >= n:
            break
    labels = sorted(chosen)[:n]
    return torch.stack([chosen[k] for k in labels]), torch.tensor(labels)


def privacy_evaluation(backbone, data, cfg: PrivacySection, device, out_dir: Path) -> dict[str, Any]:
    """MJP Table 5 settings (a) / (b) / (c) on one test image per class; writes ``privacy.png`` (Fig. 5 style)."""
    from tqdm import tqdm

    images, labels = one_per_class(data.val, cfg.images, 256)
    if len(images) % cfg.batch_size:
        raise ConfigError(f"privacy.batch_size {cfg.batch_size} must divide the {len(images)} images")
    shuffled, mask = jigsaw(images, backbone.config.patch_size, cfg.ratio,
                            generator=torch.Generator().manual_seed(cfg.seed))
    norm = data.normalization or {"mean": [0.0], "std": [1.0]}
    with tqdm(total=2 * len(images) // cfg.batch_size, desc="privacy: client updates attacked") as bar:
        result = privacy_settings(backbone.float(), images.to(device), labels.to(device), shuffled=shuffled.to(device),
                                  unknown_pos=mask.to(device), mean=norm["mean"], std=norm["std"],
                                  attack=cfg.attack(), batch_size=cfg.batch_size, analytic=cfg.analytic,
                                  progress=lambda _: bar.update())
    plot_privacy(result, out_dir / "privacy.png")
    arrays = {"originals": result.originals, "shuffled": result.shuffled}
    arrays |= {f"{a}_{k}": t for a, r in result.reconstructions.items() for k, t in r.items()}
    with atomic_file(out_dir / "privacy.npz") as tmp:  # pixel-space images for figures combining several models
        np.savez_compressed(tmp, **{k: v.numpy() for k, v in arrays.items()})
    return {"metrics": result.metrics, **result.info, "ratio": cfg.ratio, "labels": labels.tolist()}


def plot_privacy(result, path: Path) -> None:
    """``privacy.png``: x, its reconstructions (a) by each attack, x~, its reconstructions (b)."""
    recs = {a.replace("_", " "): {k: t.numpy() for k, t in r.items()} for a, r in result.reconstructions.items()}
    plot_privacy_grid(result.originals.numpy(), result.shuffled.numpy(), {a: r["a"] for a, r in recs.items()},
                      {a: r["b"] for a, r in recs.items()}, path,
                      "gradient inversion: originals vs reconstructions (MJP Fig. 5)")


def plot_evaluation(results: dict[str, Any], classes: list[str], out_dir: Path) -> list[str]:
    """``evaluation.png`` for any checkpoint kind: one panel per result it has — confusion matrix (classifiers),
    linear probe top-1 per label fraction, kNN top-1 per layer, MJP consistency / Diff. Norm per gamma."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "confusion" in results.get("classification", {}):
        panels.append("confusion")
    probes = {**({"100%": results["linear_probe"]["top1"]} if "linear_probe" in results else {}),
              **({f"{results['linear_probe_low_label']['fraction']:.0%} (probe set)":
                  results["linear_probe_low_label"]["top1"]} if "linear_probe_low_label" in results else {}),
              **{f"{float(f):.0%}": r["top1"] for f, r in results.get("linear_probe_label_fraction", {}).items()}}
    if probes:
        panels.append("probes")
    if results.get("knn_per_layer"):
        panels.append("knn")
    if results.get("consistency"):
        panels.append("consistency")
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "confusion":
            matrix = np.asarray(results["classification"]["confusion"], dtype=float)
            ax.imshow(matrix / np.maximum(matrix.sum(1, keepdims=True), 1), cmap="Blues", vmin=0, vmax=1)
            ax.set(title=f"confusion (top-1 {results['classification']['top1']:.3f})", xlabel="predicted",
                   ylabel="true", xticks=range(len(classes)), yticks=range(len(classes)))
            ax.set_xticklabels(classes, rotation=90, fontsize=6)
            ax.set_yticklabels(classes, fontsize=6)
        elif panel == "probes":
            ax.bar(list(probes), list(probes.values()))
            ax.set(title="linear probe top-1 by labels", ylim=(0, 1))
        elif panel == "knn":
            layers = sorted(results["knn_per_layer"], key=int)
            ax.plot([int(k) for k in layers], [results["knn_per_layer"][k] for k in layers], marker="o")
            ax.set(title="kNN top-1 per layer", xlabel="layer", ylim=(0, 1))
        else:
            gammas = sorted(results["consistency"], key=float)
            ax.plot([float(g) for g in gammas], [results["consistency"][g]["consistency"] for g in gammas],
                    marker="o", label="consistency")
            ax.plot([float(g) for g in gammas], [results["consistency"][g]["diff_norm"] for g in gammas],
                    marker="o", label="Diff. Norm")
            ax.set(title="patch-shuffle consistency (MJP)", xlabel="gamma")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "evaluation.png", dpi=110)
    plt.close(fig)
    return ["evaluation.png"]


def to_markdown(results: dict[str, Any]) -> str:
    lines = [f"# Evaluation of {results['checkpoint']}", "", f"method: {results['method']}", ""]
    if "classification" in results:
        c = results["classification"]
        lines += [f"- top-1 {c['top1']:.4f}, top-5 {c['top5']:.4f} on {c['count']} images"]
    if "probe_feature" in results:
        lines += [f"- probes read `{results['probe_feature']}` (the feature this checkpoint's training trained)"]
    for key in ("linear_probe", "linear_probe_low_label", "position_probe"):
        if key in results:
            lines += [f"- {key.replace('_', ' ')}: top-1 {results[key]['top1']:.4f}"]
    for fraction, result in results.get("linear_probe_label_fraction", {}).items():
        lines += [f"- linear probe on {float(fraction):.0%} of the train labels ({result['train_samples']} samples): "
                  f"top-1 {result['top1']:.4f}"]
    if "knn_per_layer" in results:
        lines += ["- kNN top-1 per layer: " + ", ".join(f"{k}: {v:.3f}" for k, v in results["knn_per_layer"].items())]
    if "consistency" in results:
        lines += ["", "| eval gamma | consistency | Diff. Norm |", "| --- | --- | --- |"]
        lines += [f"| {g} | {v['consistency']:.4f} | {v['diff_norm']:.4f} |" for g, v in results["consistency"].items()]
    if "mp3_position_accuracy" in results:
        lines += ["", "| eval eta | position top-1 | top-5 |", "| --- | --- | --- |"]
        lines += [f"| {e} | {v['top1']:.4f} | {v['top5']:.4f} |" for e, v in results["mp3_position_accuracy"].items()]
    if "droppos_grid" in results:
        lines += ["", "DropPos position accuracy: " + ", ".join(f"{k}: {v:.3f}" for k, v in
                                                          results["droppos_grid"].items())]
    if "privacy" in results:
        p = results["privacy"]
        lines += ["", f"Gradient inversion (MJP Table 5) on {p['images']} images, jigsaw gamma {p['ratio']}, "
                  f"{p['batch_size']} image(s) per update; privacy is better with higher MSE and lower PSNR / SSIM / "
                  "FFT2D:", "", "| attack | setting | MSE | PSNR | SSIM | FFT2D |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {a} | {s} | {v['mse']:.4f} | {v['psnr']:.2f} | {v['ssim']:.3f} | {v['fft2d']:.3f} |"
                  for a, settings in p["metrics"].items() for s, v in settings.items()]
    return "\n".join(lines) + "\n"


def label_fraction_probes(backbone, data, fractions: tuple[float, ...], subset_seed: int, test_features,
                          pool: str, batch_size: int, device, epochs: int) -> dict[str, dict[str, Any]]:
    """Linear probes trained on class-balanced fractions of the whole train split — the subsets fine-tuning uses
    with ``data.label_fraction`` (:func:`balanced_subset`, same seed) — and tested on ``test_features``."""
    if not isinstance(data.train, MemoryReader):
        raise ConfigError("eval.label_fractions needs data.train in memory (data.in_memory=auto and enough "
                          "data.memory_budget_mb): the subsets are drawn from the whole split")
    split, (te, te_y) = data.train.split, test_features
    results = {}
    for fraction in fractions:
        subset = MemoryReader(split.subset(balanced_subset(split.labels, fraction, subset_seed)),
                              data.train.transform, shuffle=False, device=device)
        batches = list(subset.batches(batch_size, epoch=0))
        if data.frontend is not None:
            batches = [(data.frontend(x), y) for x, y in batches]
        tr, tr_y = extract_features(backbone, batches, pool=pool, device=device)
        results[f"{fraction:g}"] = {**probe(f"linear probe, {fraction:.0%} of the labels", tr[max(tr)], tr_y,
                                            te[max(te)], te_y, num_classes=data.manifest.num_classes, epochs=epochs),
                                    "train_samples": len(tr_y), "label_subset_seed": subset_seed}
    return results


def evaluation(cfg: EvaluateConfig, data: Data, backbone, metadata: dict[str, Any], device) -> dict[str, Any]:
    """Every result the config asks for, written to run.output (``results.json``, ``report.md``, the plots);
    raises a user error (one line) where a part cannot run."""
    ev, bs = cfg.eval, cfg.data.batch_size
    backbone = backbone.to(device).eval()
    out_dir = Path(cfg.run.output)
    if cfg.run.overwrite:  # an earlier evaluation's files go: none of them is listed or read as this one's
        for name in RESULT_FILES:
            (out_dir / name).unlink(missing_ok=True)
    results: dict[str, Any] = {"checkpoint": cfg.model.checkpoint, "method": metadata.get("method")}
    is_image = data.manifest.modality == "image"
    if backbone.config.num_classes == data.manifest.num_classes:
        results["classification"] = classify(backbone, data.val, bs, device, data.frontend)
    train_x, train_y = first_images(data.train, ev.probe_train_samples, bs)
    results["probe_train_samples"] = len(train_y)  # the whole train split is read, on any number of processes
    train = list(zip(train_x.split(bs), train_y.split(bs), strict=True))
    val = list(data.val.batches(bs, epoch=0))
    if data.frontend is not None:
        train = [(data.frontend(x.to(device)).cpu(), y) for x, y in train]
        val = [(data.frontend(x.to(device)).cpu(), y) for x, y in val]
    try:
        pool = probe_feature_of(metadata, backbone)  # the feature the checkpoint's training trained (docs/design.md)
    except ValueError as exc:
        raise ConfigError(f"{cfg.model.checkpoint}: {exc}") from None
    results["probe_feature"] = pool
    results["probe_pos_embed"] = backbone.config.pos_embed  # with the feature: the random-init control it reads
    if ev.linear_probe:
        tr, tr_y = extract_features(backbone, train, pool=pool, device=device)
        te, te_y = extract_features(backbone, val, pool=pool, device=device)
        results["linear_probe"] = probe("linear probe", tr[max(tr)], tr_y, te[max(te)], te_y,
                                        num_classes=data.manifest.num_classes, epochs=ev.probe_epochs)
        few = subsample_per_class(tr_y, ev.low_label_fraction)  # StoP / I-JEPA also report 1% of the labels
        results["linear_probe_low_label"] = {**probe(f"linear probe, {ev.low_label_fraction:.0%} of the probe labels",
                                                     tr[max(tr)][few], tr_y[few], te[max(te)], te_y,
                                                     num_classes=data.manifest.num_classes, epochs=ev.probe_epochs),
                                             "fraction": ev.low_label_fraction, "train_samples": len(few)}
    if ev.label_fractions:
        if not ev.linear_probe:
            te, te_y = extract_features(backbone, val, pool=pool, device=device)
        results["linear_probe_label_fraction"] = label_fraction_probes(
            backbone, data, ev.label_fractions, cfg.data.label_subset_seed, (te, te_y), pool, bs, device,
            ev.probe_epochs)
    if ev.knn:
        results["knn_per_layer"] = knn_probe_per_layer(backbone, train, val, num_classes=data.manifest.num_classes,
                                                       device=device, pool="mean" if pool == "cls" else pool)
    if ev.position_probe:
        results["position_probe"] = position_probe(backbone, train, val, device=device,
                                                   class_token=pool != "patch_mean")
    if is_image:
        images, _ = first_images(data.val, ev.max_eval_samples, bs)
        if backbone.config.num_classes == data.manifest.num_classes and ev.consistency_ratios:
            results["consistency"] = consistency_curve(
                torch_predict(backbone), images, backbone.config.patch_size, ev.consistency_ratios,
                mark_unknown=backbone.unknown_pos_embed is not None, batch_size=bs)
        results.update(method_curves(backbone, metadata, Path(cfg.model.checkpoint), images, out_dir))
    if cfg.privacy.enabled:
        results["privacy"] = privacy_evaluation(backbone, data, cfg.privacy, device, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot_evaluation(results, data.manifest.classes, out_dir) + sorted(
        p.name for p in out_dir.glob("*.png") if p.name != "evaluation.png")
    for name, text in (("results.json", json.dumps(results, indent=2) + "\n"), ("report.md", to_markdown(results))):
        with atomic_file(out_dir / name) as tmp:  # a kill never leaves a half-written result
            tmp.write_text(text)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--privacy" in argv:  # shorthand for privacy.enabled=true
        argv = [a for a in argv if a != "--privacy"] + ["privacy.enabled=true"]
    try:
        args = parser(EvaluateConfig, __doc__, argv).parse_args(argv)
        refuse_earlier_results(load(EvaluateConfig, args.config, args.overrides))  # before anything is read
        cfg, accelerator, data = start(EvaluateConfig, __doc__, argv, augment=False, split_train=False)
        backbone, metadata = load_pretrained(cfg.model.checkpoint)
        preflight(cfg, data, backbone, metadata)
        if not accelerator.is_main_process:
            return 0
        results = evaluation(cfg, data, backbone, metadata, accelerator.device)
    except USER_ERRORS as exc:  # ConfigError, DataError, ModelError, PrivacyError, a non-finite output, ...
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    print(to_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
