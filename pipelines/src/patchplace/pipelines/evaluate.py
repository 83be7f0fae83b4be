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

The probes are streamed (docs/pipelines.md, "Evaluation protocols"): on one process or several (``accelerate launch
--multi_gpu``), each extracts its share of the splits batch by batch into a feature store under
``run.output/features/`` and scores its share of the classification and of the kNN; the linear probes (the papers'
recipes, ``eval.probe_*``: MAE / RandSAC's LARS, StoP / I-JEPA's SGD and last-4-layer concatenation) and the
low-label ones (StoP's logistic regression, ImageNet 1% / 10% lists) train on the main process from the store.
Memory does not grow with the splits, and the results equal one process's.

Refused in one line, before anything is computed: a ``run.output`` holding an earlier evaluation's results (unless
``run.overwrite=true``, which replaces them) or a training run whose lock a live process holds, images the
checkpoint trained on (``data.val`` = its training split, or ``data.val=holdout`` outside the hold-out it records), a
classifier on data whose classes (names, order) are not its own, inputs the model cannot take, a label-subset list
naming samples data.train lacks, a sample twice or one class only, and fewer probe samples than classes. Every split
is normalized with the checkpoint's training statistics; a streamed and an in-memory split give the same results
(``results.json`` records ``data.mode``). A stopped (SIGTERM: one line, exit 143) or failed evaluation leaves no
features behind on any process.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.pipelines.evaluate`, before the imports below load torch:
    # cli answers --help from the torch-free config classes (as for pipelines/evaluate.py, byte for byte) and runs
    # anything else through this module imported by its name
    from patchplace.pipelines import cli

    sys.exit(cli.main("evaluate"))

import contextlib
import json
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from patchplace.data.atomic import atomic_file
from patchplace.data.manifest import class_list, first_difference
from patchplace.data.memory import MemoryReader, balanced_subset
from patchplace.data.mfcc import build_frontend
from patchplace.finetune import (
    LAST_LAYERS,
    FeatureStore,
    ProbeRecipe,
    consistency_curve,
    feature_names,
    match_subset,
    pooled_features,
    position_probe,
    privacy_settings,
    probe_feature_of,
    read_subset_file,
    score,
    standardization,
    subsample_per_class,
    torch_predict,
    train_probe,
)
from patchplace.finetune.probe_recipes import logistic_regression_chunked
from patchplace.models import ModelError, load_pretrained
from patchplace.models.hub import check_finite
from patchplace.objectives import (
    MethodSpec,
    get_method,
    jigsaw,
    method_names,
    position_accuracy_grid,
    position_accuracy_vs_eta,
    reassemble,
)
from patchplace.pipelines.commands import EvalSection, EvaluateConfig, PrivacySection, expand_flags
from patchplace.pipelines.config import ConfigError, check_path, command_args, load, parser
from patchplace.pipelines.engine import (
    USER_ERRORS,
    Data,
    Interrupted,
    check_inputs,
    classify,
    holdout_indices,
    report,
    start,
)
from patchplace.pipelines.engine.protocol import LOCK, RunLock
from patchplace.pipelines.engine.rundir import holds_run
from patchplace.pipelines.evaluation import (
    Ranks,
    SharedBatches,
    knn_per_layer,
    leading_images,
    ordered_batches,
    plot_privacy_grid,
    split_keys,
    split_size,
    store_split,
)
from patchplace.pipelines.sections import HOLDOUT, DataSection

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
    check_path("run.output", cfg.run.output)  # (a name too long to create: one line, not an OSError)
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
    check_subset_files(cfg, data)
    check_probe_samples(cfg, m)
    if "last4" in cfg.eval.probe_layers and cfg.eval.linear_probe and len(backbone.blocks) < LAST_LAYERS:
        print(f"note: eval.probe_layers=last4 concatenates all {len(backbone.blocks)} blocks of {checkpoint} (fewer "
              f"than {LAST_LAYERS})", file=sys.stderr)


def check_subset_files(cfg: EvaluateConfig, data: Data) -> None:
    """Each eval.label_subset_files list names samples of data.train (each once) of two classes or more: matched
    against the split's keys before any feature is extracted (local shards' tar headers, or the split in memory;
    shards read by URL are matched once their features are stored)."""
    import tarfile

    for file in cfg.eval.label_subset_files:
        names, labels = read_subset_file(file), []
        chunks = split_keys(data.train, split_rows(data.train), labels)
        if chunks is None:
            continue
        try:
            rows = match_subset(chunks, names, f"eval.label_subset_files {file}")
        except (OSError, tarfile.TarError):  # a shard that cannot be listed: the reader names it when it reads it
            continue
        check_subset_classes(np.concatenate(labels)[rows], file, data.manifest.classes)


def check_subset_classes(labels: np.ndarray, file: str, classes: list[str] | None = None) -> None:
    """A label subset of one class trains no classifier: refused, naming the class."""
    found = np.unique(labels)
    if len(found) < 2:
        name = repr(classes[int(found[0])]) if classes else f"label {int(found[0])}"
        raise ConfigError(f"eval.label_subset_files {file} lists {len(labels)} samples, all of class "
                          f"{name}: a probe needs samples of two classes or more (list the "
                          "subset's samples of every class)")


def check_probe_samples(cfg: EvaluateConfig, manifest) -> None:
    """eval.probe_train_samples below the number of classes leaves classes the linear and kNN probes never see
    (their top-1 would be bounded by the classes drawn, not the features): refused."""
    n, classes = cfg.eval.probe_train_samples, manifest.num_classes
    if (cfg.eval.linear_probe or cfg.eval.knn) and n and n < classes:
        raise ConfigError(f"eval.probe_train_samples={n} is fewer than the {classes} classes of "
                          f"{manifest.dataset}/{manifest.split}: the probes could not see every class; give at "
                          f"least {classes} (or 0: all of data.train)")


def curve_method(metadata: dict[str, Any]) -> MethodSpec | None:
    """The checkpoint's method when its saved objective gives evaluation curves (its registration says so)."""
    method = metadata.get("method")
    if method not in method_names():
        return None
    spec = get_method(method)
    return spec if spec.curves else None


def method_curves(backbone, metadata: dict, checkpoint: Path, images: torch.Tensor, out_dir: Path) -> dict:
    """The curves the checkpoint's method registers (``MethodSpec.curves``, a name of :data:`CURVES`), drawn from
    the saved objective parameters (on the backbone's device; the images and the picture stay on the CPU)."""
    spec, extras = curve_method(metadata), checkpoint / "objective.safetensors"
    if spec is None or not extras.is_file():
        return {}
    if spec.curves not in CURVES:
        raise ModelError(f"evaluate has no curves {spec.curves!r} for {spec.name}: register it with curves in "
                         f"{sorted(CURVES)} or none")
    objective = spec.build(backbone, metadata.get("objective", {}))
    state = objective_state(extras)
    missing, unexpected = objective.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("backbone.") for k in missing):
        raise ModelError(f"{extras} does not match the {spec.name} objective")
    device = next(backbone.parameters()).device
    return CURVES[spec.curves](objective.to(device), images, images.to(device), out_dir)


def position_grid_curves(objective, images: torch.Tensor, on_device: torch.Tensor, out_dir: Path) -> dict:
    """DropPos: position accuracy over the (gamma, gamma_pos) grid (:func:`position_accuracy_grid`)."""
    grid = position_accuracy_grid(objective, on_device, generator=torch.Generator().manual_seed(0))
    return {"droppos_grid": {("mean" if k == "mean" else f"gamma={k[0]},gamma_pos={k[1]}"): v
                             for k, v in grid.items()}}


def eta_curves(objective, images: torch.Tensor, on_device: torch.Tensor, out_dir: Path) -> dict:
    """MP3: position accuracy against the evaluation masking ratio eta (Fig. 3) + a reassembled picture."""
    # 0.55 (where MP3 Fig. 3 puts the train-0.75 peak) last: the masks drawn for the other etas stay the same
    curve = position_accuracy_vs_eta(objective, on_device, etas=(0.0, 0.25, 0.5, 0.75, 0.9, 0.55),
                                     generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = objective.eval().position_logits(on_device[:8], eta=0.0)[0].float().cpu()
    picture = reassemble(images[:8], logits, objective.backbone.config.patch_size)
    plot_mp3(curve, images[:8], picture, out_dir)
    return {"mp3_position_accuracy": {str(k): v for k, v in curve.items()}}


# The curves a method's registration may name (MethodSpec.curves): each draws from its objective and the images.
CURVES = {"position_grid": position_grid_curves, "eta": eta_curves}


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
    """The first test image of each class (manifest order, on either reader), in class order, up to ``n`` (a fixed
    set: same images for every model)."""
    chosen: dict[int, torch.Tensor] = {}
    for x, y in ordered_batches(dataset, torch.arange(split_rows(dataset)), batch_size):
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
              **({"100%, last 4": results["linear_probe_last4"]["top1"]} if "linear_probe_last4" in results else {}),
              **({f"{results['linear_probe_low_label']['fraction']:.0%} (probe set)":
                  results["linear_probe_low_label"]["top1"]} if "linear_probe_low_label" in results else {}),
              **{f"{float(f):.0%}": r["top1"] for f, r in results.get("linear_probe_label_fraction", {}).items()},
              **{name: r["top1"] for name, r in results.get("linear_probe_label_subset", {}).items()}}
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
            ax.tick_params(axis="x", labelrotation=30, labelsize=7)
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
    for key in ("linear_probe", "linear_probe_last4", "linear_probe_low_label", "position_probe"):
        if key in results:
            solver = f" ({results[key]['solver']})" if "solver" in results[key] else ""
            lines += [f"- {key.replace('_', ' ')}{solver}: top-1 {results[key]['top1']:.4f}"]
    for fraction, result in results.get("linear_probe_label_fraction", {}).items():
        lines += [f"- {result['solver']} probe on {float(fraction):.0%} of the train labels ({result['train_samples']} "
                  f"samples): top-1 {result['top1']:.4f}"]
    for name, result in results.get("linear_probe_label_subset", {}).items():
        lines += [f"- {result['solver']} probe on the samples listed in {name} ({result['train_samples']}): top-1 "
                  f"{result['top1']:.4f}"]
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


@dataclass
class Stores:
    """The stored features of an evaluation: data.train's (``probe``: the rows of the probe's samples) and
    data.val's; None where no probe needs them."""

    train: FeatureStore | None
    val: FeatureStore | None
    probe: np.ndarray


def split_rows(reader) -> int:
    """The samples of a split evaluation reads: all, or the first data.train_limit / data.val_limit."""
    return min(split_size(reader), reader.epoch_length or split_size(reader))


def probe_positions(rows: int, samples: int | None, seed: int) -> torch.Tensor:
    """Sorted positions (manifest order) of the probe's train samples: all ``rows``, or ``samples`` of them drawn
    by ``seed`` (the same ones on any number of processes; shards written class by class are covered evenly)."""
    if not samples or samples >= rows:
        return torch.arange(rows)
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:samples].sort().values


def stored_features(ev: EvalSection, depth: int) -> list[str]:
    """The features the asked probes read (finetune.feature_store names)."""
    low_label = ev.label_fractions or ev.label_subset_files
    return feature_names(depth, last=(ev.linear_probe and "last" in ev.probe_layers) or bool(low_label)
                         or (ev.linear_probe and ev.low_label_fraction > 0),
                         last4=ev.linear_probe and "last4" in ev.probe_layers, blocks=ev.knn)


def build_stores(cfg: EvaluateConfig, data: Data, backbone, pool: str, device, ranks: Ranks) -> Stores:
    """Every process extracts its share of the samples the probes need into ``run.output/features/<split>``
    (finetune.FeatureStore): data.train's probe samples (all of data.train for eval.label_fractions /
    eval.label_subset_files) and the whole data.val; memory: a batch, whatever the splits' size."""
    ev, folder = cfg.eval, Path(cfg.run.output) / "features"
    train_rows = split_rows(data.train)
    probe = probe_positions(train_rows, ev.probe_train_samples, cfg.run.seed)
    names = stored_features(ev, len(backbone.blocks))
    if not names:
        return Stores(None, None, probe.numpy())
    if ranks.main:  # an earlier evaluation's features go (each process then writes only its own part)
        shutil.rmtree(folder, ignore_errors=True)
    ranks.barrier()

    def extract(x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.to(device)
        return pooled_features(backbone, data.frontend(x) if data.frontend is not None else x, pool, names)

    wanted = torch.arange(train_rows) if ev.label_fractions or ev.label_subset_files else probe
    say(ranks, f"features: {', '.join(names)} of {len(wanted)} data.train and {split_rows(data.val)} data.val "
        f"samples on {ranks.world} process(es), stored in {folder}")
    train = store_split("data.train", data.train, wanted, names, extract, folder / "train", ranks,
                        cfg.data.batch_size)
    val = store_split("data.val", data.val, torch.arange(split_rows(data.val)), names, extract, folder / "val",
                      ranks, cfg.data.batch_size)
    return Stores(train, val, np.searchsorted(np.asarray(train.positions), probe.numpy()))


def say(ranks: Ranks, text: str) -> None:
    if ranks.main:
        print(text, flush=True)


def shared_classification(backbone, data: Data, batch_size: int, device, ranks: Ranks) -> dict[str, Any]:
    """Top-1 / top-5 / confusion of the checkpoint's head on data.val, each process scoring its share; the counts
    are summed (exactly what one process counts)."""
    share = SharedBatches(data.val, torch.arange(split_rows(data.val)), ranks)
    mine = classify(backbone, share, batch_size, device, data.frontend)
    confusion = torch.tensor(mine["confusion"], dtype=torch.int64)
    counts = torch.tensor([mine["count"], int(confusion.trace()), round(mine["top5"] * mine["count"])])
    total = ranks.total(torch.cat([counts, confusion.flatten()]))
    n = max(int(total[0]), 1)
    return {"top1": int(total[1]) / n, "top5": int(total[2]) / n, "count": int(total[0]),
            "confusion": total[3:].reshape(confusion.shape).tolist()}


def recipe_probe(recipe: ProbeRecipe, stores: Stores, name: str, rows: np.ndarray, num_classes: int, device,
                 seed: int, desc: str) -> dict[str, Any]:
    """The linear probe of ``recipe`` on the train store's ``rows`` of feature ``name``, scored on data.val."""
    from tqdm import tqdm

    def batch(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return stores.train.rows(name, rows[index.numpy()])

    with tqdm(total=recipe.epochs, desc=desc, unit="epoch", leave=False) as bar:
        head = train_probe(recipe, batch, len(rows), stores.train.dims[name], num_classes, seed=seed,
                           device=device, progress=bar.update)
    scored = score(head, stores.val.chunks(name), device)
    return {"top1": scored["top1"], "top5": scored["top5"], "train_samples": len(rows), "feature": name,
            "dim": stores.train.dims[name]}


def logistic_probe(stores: Stores, rows: np.ndarray, num_classes: int, lambd: float) -> dict[str, Any]:
    """StoP's low-shot probe (logistic_eval.py) on the train store's ``rows`` of the last layer: the regression
    on the rows standardized by their own statistics; data.val's features standardized by data.val's own, as the
    authors' script does. The rows are read from the store chunk by chunk at every objective evaluation
    (:func:`logistic_regression_chunked`): memory of the weights, not of the rows."""
    model = logistic_regression_chunked(lambda: stores.train.chunks("last", rows), num_classes, lambd)
    mean, std = standardization(x for x, _ in stores.val.chunks("last"))
    scored = score(lambda v: model.logits(v.cpu(), mean, std), stores.val.chunks("last"))
    return {"top1": scored["top1"], "top5": scored["top5"], "train_samples": len(rows), "feature": "last",
            "lambda": lambd, "iterations": model.iterations}


def label_probe(ev: EvalSection, stores: Stores, rows: np.ndarray, num_classes: int, device, seed: int,
                desc: str) -> dict[str, Any]:
    """The low-label probe of eval.label_probe on ``rows`` (sorted) of the train store."""
    if ev.label_probe == "logistic":
        return {**logistic_probe(stores, rows, num_classes, ev.logistic_lambda), "solver": "logistic"}
    return {**recipe_probe(ev.recipe(), stores, "last", rows, num_classes, device, seed, desc), "solver": "linear"}


def frozen_probes(cfg: EvaluateConfig, stores: Stores, num_classes: int, device) -> dict[str, Any]:
    """The linear probes (eval.probe_layers), the low-label probes and the label-fraction / subset-list probes,
    trained on the main process from the stores."""
    ev, seed, out = cfg.eval, cfg.run.seed, {}
    recipe = ev.recipe()
    if ev.linear_probe:
        for layer in ev.probe_layers:
            key = "linear_probe" if layer == "last" else "linear_probe_last4"
            out[key] = {**recipe_probe(recipe, stores, layer, stores.probe, num_classes, device, seed,
                                       f"linear probe ({layer})"), "recipe": recipe.record()}
        if ev.low_label_fraction > 0:
            labels = torch.from_numpy(np.asarray(stores.train.labels[stores.probe]))
            few = stores.probe[subsample_per_class(labels, ev.low_label_fraction).numpy()]
            out["linear_probe_low_label"] = {**label_probe(ev, stores, few, num_classes, device, seed,
                                                           f"{ev.low_label_fraction:.0%} of the probe's labels"),
                                             "fraction": ev.low_label_fraction}
    if ev.label_fractions:
        labels = torch.from_numpy(np.array(stores.train.labels))
        out["linear_probe_label_fraction"] = {
            f"{fraction:g}": {**label_probe(ev, stores, balanced_subset(labels, fraction, cfg.data.label_subset_seed)
                                            .numpy(), num_classes, device, seed, f"{fraction:.0%} of the labels"),
                              "label_subset_seed": cfg.data.label_subset_seed} for fraction in ev.label_fractions}
    if ev.label_subset_files:
        out["linear_probe_label_subset"] = {}
        for file in ev.label_subset_files:
            rows = match_subset(stores.train.key_chunks(), read_subset_file(file), f"eval.label_subset_files {file}")
            check_subset_classes(np.asarray(stores.train.labels[rows]), file)
            out["linear_probe_label_subset"][Path(file).name] = {
                **label_probe(ev, stores, rows, num_classes, device, seed, Path(file).name), "file": file}
    return out


def positions_batches(data: Data, reader, positions: torch.Tensor, batch_size: int, device
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, labels)`` of ``positions`` of a split, read batch by batch on this process (the frontend on), in
    the same batches from memory or streamed (:func:`ordered_batches`)."""
    for x, y in ordered_batches(reader, positions, batch_size):
        x = x.to(device)
        yield (data.frontend(x) if data.frontend is not None else x), y


def shared_results(cfg: EvaluateConfig, data: Data, backbone, pool: str, device, ranks: Ranks
                   ) -> tuple[dict[str, Any], Stores]:
    """What every process computes its share of: classification, the feature stores, the layer-wise kNN."""
    results: dict[str, Any] = {}
    if backbone.config.num_classes == data.manifest.num_classes:
        results["classification"] = shared_classification(backbone, data, cfg.data.batch_size, device, ranks)
    stores = build_stores(cfg, data, backbone, pool, device, ranks)
    results["probe_train_samples"] = len(stores.probe)  # drawn from the whole split, on any number of processes
    if cfg.eval.knn:
        results["knn_per_layer"] = knn_per_layer(stores.train, stores.probe, stores.val, len(backbone.blocks),
                                                 data.manifest.num_classes, ranks, device)
    return results, stores


def evaluation(cfg: EvaluateConfig, data: Data, backbone, metadata: dict[str, Any], device,
               ranks: Ranks | None = None) -> dict[str, Any] | None:
    """Every result the config asks for, written to run.output (``results.json``, ``report.md``, the plots) by
    the main process, which returns them (the others return None once their shares are done); raises a user error
    (one line) where a part cannot run."""
    ev, ranks = cfg.eval, ranks or Ranks()
    backbone = backbone.to(device).eval()
    out_dir = Path(cfg.run.output)
    if cfg.run.overwrite and ranks.main:  # an earlier evaluation's files go: none is listed or read as this one's
        for name in RESULT_FILES:
            (out_dir / name).unlink(missing_ok=True)
    results: dict[str, Any] = {"checkpoint": cfg.model.checkpoint, "method": metadata.get("method"),
                               "data": data_record(data)}
    try:
        pool = probe_feature_of(metadata, backbone)  # the feature the checkpoint's training trained (docs/design.md)
    except ValueError as exc:
        raise ConfigError(f"{cfg.model.checkpoint}: {exc}") from None
    try:
        with sigterm_raises():
            shared, stores = shared_results(cfg, data, backbone, pool, device, ranks)
            if not ranks.main:
                return None
            return main_results(cfg, data, backbone, metadata, device, {**results, **shared}, stores, pool)
    finally:  # an evaluation that fails half-way, or is stopped, leaves no features behind either
        remove_features(out_dir / "features", ranks, ev.keep_features)


class EvaluationInterrupted(Interrupted):
    """SIGTERM stopped this process's evaluation (its features removed); a rank's own stop, not agreed."""

    every_rank = False


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM (a user's ``kill``, the launcher ending the other ranks once one failed) raises
    :class:`EvaluationInterrupted` in the main thread, so the ``finally`` clauses run (the features removed); a
    second SIGTERM then acts at once (the previous handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, previous)
        raise EvaluationInterrupted("interrupted by SIGTERM: the evaluation stopped, no results written and its "
                                    "features removed; run it again", 128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_features(folder: Path, ranks: Ranks, keep: bool) -> None:
    """What an evaluation leaves of ``run.output/features`` on this machine: each rank removes its own parts (also
    where run.output is not one folder every machine shares, so nothing but this rank wrote them here); without
    eval.keep_features the main rank removes the stores, and the other ranks the folders their parts left, once
    empty (on a shared run.output, the main rank may still be reading the stores)."""
    for split in ("train", "val"):
        shutil.rmtree(folder / split / f"part-{ranks.rank}", ignore_errors=True)
    if keep:
        return
    if ranks.main:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for empty in (folder / "train", folder / "val", folder):
        with contextlib.suppress(OSError):
            empty.rmdir()


def data_record(data: Data) -> dict[str, str]:
    """What read the splits: ``mode`` ``in_memory`` (data.in_memory) or ``streamed`` (shards read batch by batch),
    ``mixed`` when data.train and data.val differ; every result is the same on either."""
    modes = {split: "in_memory" if isinstance(reader, MemoryReader) else "streamed"
             for split, reader in (("train", data.train), ("val", data.val))}
    return {"mode": modes["val"] if len(set(modes.values())) == 1 else "mixed", **modes}


def main_results(cfg: EvaluateConfig, data: Data, backbone, metadata: dict[str, Any], device,
                 results: dict[str, Any], stores: Stores, pool: str) -> dict[str, Any]:
    """The main process's part: the probes trained from the stores, the position probe, the image results; the
    files written."""
    ev, bs, out_dir = cfg.eval, cfg.data.batch_size, Path(cfg.run.output)
    results["probe_feature"] = pool
    results["probe_pos_embed"] = backbone.config.pos_embed  # with the feature: the random-init control it reads
    results.update(frozen_probes(cfg, stores, data.manifest.num_classes, device))
    if ev.position_probe:  # on the probe's train samples and all of data.val, read batch by batch (main process)
        probe = torch.from_numpy(np.asarray(stores.train.positions[stores.probe])) if stores.train is not None \
            else probe_positions(split_rows(data.train), ev.probe_train_samples, cfg.run.seed)
        results["position_probe"] = position_probe(
            backbone, positions_batches(data, data.train, probe, bs, device),
            positions_batches(data, data.val, torch.arange(split_rows(data.val)), bs, device), device=device,
            class_token=pool != "patch_mean")
    results.update(image_results(cfg, data, backbone, metadata, device, out_dir))
    write_results(results, data, out_dir)
    return results


def image_results(cfg: EvaluateConfig, data: Data, backbone, metadata: dict[str, Any], device, out_dir: Path
                  ) -> dict[str, Any]:
    """MJP consistency, the method's own curves and the privacy evaluation (main process, bounded image sets)."""
    results: dict[str, Any] = {}
    if data.manifest.modality == "image":
        images, _ = leading_images(data.val, cfg.eval.max_eval_samples, cfg.data.batch_size)
        if backbone.config.num_classes == data.manifest.num_classes and cfg.eval.consistency_ratios:
            results["consistency"] = consistency_curve(
                torch_predict(backbone), images, backbone.config.patch_size, cfg.eval.consistency_ratios,
                mark_unknown=backbone.unknown_pos_embed is not None, batch_size=cfg.data.batch_size)
        results.update(method_curves(backbone, metadata, Path(cfg.model.checkpoint), images, out_dir))
    if cfg.privacy.enabled:
        results["privacy"] = privacy_evaluation(backbone, data, cfg.privacy, device, out_dir)
    return results


def write_results(results: dict[str, Any], data: Data, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot_evaluation(results, data.manifest.classes, out_dir) + sorted(
        p.name for p in out_dir.glob("*.png") if p.name != "evaluation.png")
    for name, text in (("results.json", json.dumps(results, indent=2) + "\n"), ("report.md", to_markdown(results))):
        with atomic_file(out_dir / name) as tmp:  # a kill never leaves a half-written result
            tmp.write_text(text)


@contextlib.contextmanager
def run_lock(out: Path, main: bool) -> Iterator[None]:
    """A training run's folder (its ``.lock``, log or checkpoints) is evaluated into under its lock (main process):
    refused in one line while a live training process holds it, and held while the evaluation writes, so no run
    resumes there meanwhile; released with the lock file given back what it held (a plain folder gets none)."""
    if not main or not ((out / LOCK).exists() or holds_run(out)):
        yield
        return
    lock = RunLock(out).acquire()
    try:
        yield
    finally:
        lock.release(restore=True)


def ranks_of(accelerator) -> Ranks:
    """The :class:`Ranks` of an Accelerator (sums on its device: NCCL reduces GPU tensors)."""
    return Ranks(accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone,
                 lambda t: accelerator.reduce(t.to(accelerator.device), reduction="sum").cpu())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = expand_flags(argv)  # --privacy: privacy.enabled=true
    try:
        parser(EvaluateConfig, __doc__, argv).parse_args(argv)  # argparse's usage errors
        refuse_earlier_results(load(EvaluateConfig, *command_args(argv)))  # before anything is read
        cfg, accelerator, data = start(EvaluateConfig, __doc__, argv, augment=False, split_train=False)
        backbone, metadata = load_pretrained(cfg.model.checkpoint)
        if data.frontend is not None and metadata.get("frontend"):  # the speech front end the checkpoint trained on
            data.frontend = build_frontend(metadata["frontend"]).to(accelerator.device)
        preflight(cfg, data, backbone, metadata)
        with run_lock(Path(cfg.run.output), accelerator.is_main_process):
            results = evaluation(cfg, data, backbone, metadata, accelerator.device, ranks_of(accelerator))
    except (*USER_ERRORS, EvaluationInterrupted) as exc:  # ConfigError, DataError, ModelError, PrivacyError, ...
        return report(exc)  # one line, exit 2 (SIGTERM: 143); the run.output this launch created goes while empty
    accelerator.end_training()  # every rank, the others as soon as their shares are done (as the trainer's end)
    if results is not None:  # the main process (the others computed their shares)
        print(to_markdown(results))
    return 0
