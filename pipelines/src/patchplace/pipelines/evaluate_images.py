"""evaluate.py's image results, on the main process from bounded image sets: MJP consistency, the method's own
curves (:mod:`patchplace.pipelines.curves`) and MJP's gradient-inversion evaluation (``--privacy``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from patchplace.data.atomic import atomic_file
from patchplace.finetune import consistency_curve, privacy_settings, torch_predict
from patchplace.objectives import jigsaw
from patchplace.pipelines.commands import EvaluateConfig, PrivacySection
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.curves import method_curves
from patchplace.pipelines.engine import Data
from patchplace.pipelines.evaluate_probes import split_rows
from patchplace.pipelines.evaluation import leading_images, ordered_batches, plot_privacy_grid


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
