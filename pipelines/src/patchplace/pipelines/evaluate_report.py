"""evaluate.py's report: ``evaluation.png`` (one panel per result) and ``report.md``; each method's curves add
their own lines (:func:`patchplace.pipelines.curves.markdown`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from patchplace.pipelines import curves


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
    """``report.md`` (and what evaluate.py prints): each result ``results`` holds, in a line or a table."""
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
    lines += curves.markdown(results)  # the method's own curves
    if "privacy" in results:
        p = results["privacy"]
        lines += ["", f"Gradient inversion (MJP Table 5) on {p['images']} images, jigsaw gamma {p['ratio']}, "
                  f"{p['batch_size']} image(s) per update; privacy is better with higher MSE and lower PSNR / SSIM / "
                  "FFT2D:", "", "| attack | setting | MSE | PSNR | SSIM | FFT2D |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {a} | {s} | {v['mse']:.4f} | {v['psnr']:.2f} | {v['ssim']:.3f} | {v['fft2d']:.3f} |"
                  for a, settings in p["metrics"].items() for s, v in settings.items()]
    return "\n".join(lines) + "\n"
