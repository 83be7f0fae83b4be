"""MP3's curves: position accuracy against the evaluation masking ratio eta (MP3 Fig. 3) and a picture of the
patches placed at their predicted positions (Fig. 2) — "Position Prediction as an Effective Pretraining Strategy",
arXiv:2207.07611."""

from __future__ import annotations

from pathlib import Path

import torch

from patchplace.objectives import position_accuracy_vs_eta, reassemble

from .kind import CurveKind

ACCURACY, REASSEMBLED = "mp3_position_accuracy.png", "mp3_reassembled.png"


def eta_curves(objective, images: torch.Tensor, on_device: torch.Tensor, out_dir: Path) -> dict:
    """MP3: position accuracy against the evaluation masking ratio eta (Fig. 3) + a reassembled picture."""
    # 0.55 (where MP3 Fig. 3 puts the train-0.75 peak) last: the masks drawn for the other etas stay the same
    curve = position_accuracy_vs_eta(objective, on_device, etas=(0.0, 0.25, 0.5, 0.75, 0.9, 0.55),
                                     generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = objective.eval().position_logits(on_device[:8], eta=0.0)[0].float().cpu()
    picture = reassemble(images[:8], logits, objective.backbone.config.patch_size)
    plot_mp3(curve, images[:8], picture, out_dir)
    return {str(k): v for k, v in curve.items()}


def plot_mp3(curve: dict, images: torch.Tensor, picture, out_dir: Path) -> None:
    """The accuracy curve (top-1 / top-5 per eta) and the inputs above their reassembled patches."""
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
    fig.savefig(out_dir / ACCURACY, dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(2, len(images), figsize=(1.2 * len(images), 2.6))
    for i in range(len(images)):
        axes[0, i].imshow(images[i].permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray")
        axes[1, i].imshow(picture[i].squeeze(-1), cmap="gray")
        axes[0, i].axis("off")
        axes[1, i].axis("off")
    fig.suptitle("input (top) and patches placed at predicted positions (bottom), eta = 0")
    fig.tight_layout()
    fig.savefig(out_dir / REASSEMBLED, dpi=120)
    plt.close(fig)


def markdown(curve: dict) -> list[str]:
    return ["", "| eval eta | position top-1 | top-5 |", "| --- | --- | --- |",
            *(f"| {e} | {v['top1']:.4f} | {v['top5']:.4f} |" for e, v in curve.items())]


KIND = CurveKind("eta", "mp3_position_accuracy", (ACCURACY, REASSEMBLED), eta_curves, markdown)
