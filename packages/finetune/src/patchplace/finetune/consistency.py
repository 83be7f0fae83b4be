"""MJP's patch-shuffle consistency and Diff. Norm (Masked Jigsaw Puzzle, arXiv:2205.12551, Eq. 6-7, Table 1, Fig. 3) —
one implementation for the PyTorch evaluator (``pipelines/evaluate.py``) and the ONNX Runtime one
(``patchplace.export.evaluate``), so both report the same numbers for the same model.

* consistency = fraction of images whose argmax is unchanged when a block-wise jigsaw of ratio gamma shuffles them;
  models with an unknown PE (MJP) are told which positions were shuffled (the official ``consistency.py``);
* Diff. Norm = mean ||F(x) - F(x~)||_2 of **the feature the classifier head reads** (the pooled, final-normed
  class token or patch mean: ``forward_head(..., pre_logits=True)``).

The jigsaw of all images is drawn at once per ratio from one generator seeded with ``seed``: the numbers do not
depend on the batch size used to run the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from patchplace.models import Backbone
from patchplace.objectives import jigsaw

# (images (B, C, H, W) float32 normalized, unknown_pos (B, N) bool or None) -> (logits (B, K), pooled (B, D)),
# as tensors or NumPy arrays (ONNX Runtime).
Predict = Callable[[torch.Tensor, torch.Tensor | None], tuple[Any, Any]]


def torch_predict(backbone: Backbone) -> Predict:
    """A :data:`Predict` for a PyTorch classifier: eval mode, no grad, the head's input as the feature."""

    @torch.no_grad()
    def predict(x: torch.Tensor, unknown_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        backbone.eval()
        device = backbone.patch_embed.proj.weight.device  # not the final norm's: an identity with fc_norm
        unknown = unknown_pos.to(device) if unknown_pos is not None else None
        pooled = backbone.forward_head(backbone.forward_features(x.to(device), unknown), pre_logits=True)
        return backbone.head(pooled).float().cpu(), pooled.float().cpu()

    return predict


def _tensor(value: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(value) if not torch.is_tensor(value) else value).float()


def consistency_curve(predict: Predict, images: torch.Tensor, patch_size: int, ratios: Sequence[float], *,
                      mark_unknown: bool, batch_size: int = 256, seed: int = 0) -> dict[str, dict[str, float]]:
    """``{str(gamma): {"consistency", "diff_norm"}}`` over ``images`` (normalized, (B, C, H, W)) for each jigsaw
    ratio; ``mark_unknown`` passes the shuffled positions as ``unknown_pos`` (models with MJP's unknown PE)."""
    if images.dim() != 4 or len(images) == 0:
        raise ValueError(f"consistency needs a non-empty (B, C, H, W) image batch, got {tuple(images.shape)}")
    gen = torch.Generator().manual_seed(seed)
    images = images.float().cpu()
    out = {}
    for ratio in ratios:
        shuffled, marked = jigsaw(images, patch_size, ratio, generator=gen)
        same, diff = 0, 0.0
        for start in range(0, len(images), batch_size):
            part = slice(start, start + batch_size)
            logits, pooled = (_tensor(v) for v in predict(images[part], None))
            logits_s, pooled_s = (_tensor(v) for v in predict(shuffled[part], marked[part] if mark_unknown
                                                              else None))
            same += int((logits.argmax(1) == logits_s.argmax(1)).sum())
            diff += float((pooled.double() - pooled_s.double()).norm(dim=1).sum())
        out[str(ratio)] = {"consistency": same / len(images), "diff_norm": diff / len(images)}
    return out
