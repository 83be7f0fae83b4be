"""Evaluation helpers that several entry points share: the first images of a split (evaluate.py's probe set,
controls.py's), the linear probe with a progress bar (evaluate.py, controls.py), class lists named in one-line
errors, and MJP's Fig. 5 grid of gradient-inversion reconstructions (evaluate.py's ``privacy.png``, the study's
privacy figure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from patchplace.finetune import linear_probe


def first_images(dataset, n: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys, seen = [], [], 0
    for x, y in dataset.batches(batch_size, epoch=0):
        xs.append(x)
        ys.append(y)
        seen += len(x)
        if seen >= n:
            break
    return torch.cat(xs)[:n], torch.cat(ys)[:n]


def probe(desc: str, *args: Any, epochs: int, **kwargs: Any) -> dict[str, float]:
    """:func:`linear_probe` with a progress bar over its epochs."""
    from tqdm import tqdm

    with tqdm(total=epochs, desc=desc, unit="epoch", leave=False) as bar:
        return linear_probe(*args, epochs=epochs, progress=bar.update, **kwargs)


def plot_privacy_grid(originals: np.ndarray, shuffled: np.ndarray, recs_a: dict[str, np.ndarray],
                      recs_b: dict[str, np.ndarray], path: Path, title: str) -> None:
    """MJP Fig. 5 style grid, one column per image (N, C, H, W in [0, 1]): the originals x, each reconstruction of
    the update on x (setting (a)), the jigsaw x~, each reconstruction of the update on x~ (setting (b))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("x", originals), *((f"(a) {k}", v) for k, v in recs_a.items()), ("x~ (jigsaw)", shuffled),
            *((f"(b) {k}", v) for k, v in recs_b.items())]
    n = len(originals)
    fig, axes = plt.subplots(len(rows), n, figsize=(0.9 * n + 1.6, 0.95 * len(rows)), squeeze=False)
    for r, (name, images) in enumerate(rows):
        for i in range(n):
            axes[r, i].imshow(images[i].transpose(1, 2, 0).squeeze(-1), cmap="gray", vmin=0, vmax=1)
            axes[r, i].set_xticks([])
            axes[r, i].set_yticks([])
        axes[r, 0].set_ylabel(name, fontsize=6, rotation=0, ha="right", va="center")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
