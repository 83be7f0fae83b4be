"""patchplace.finetune — heads, PE swap, layer-wise lr decay, mixup/cutmix, and frozen-backbone probes.

Fine-tuning: :func:`prepare_for_finetune` (fresh head, optional PE-mode swap keeping every other weight, drop
path), :func:`finetune_optimizer` (timm AdamW with layer-wise lr decay), :func:`build_mixup` (timm).
Probes: :func:`linear_probe`, :func:`knn_probe_per_layer` (MP3 App. C), :func:`position_probe` (DropPos Table 7).
Metrics: :class:`Accuracy` (top-1 / top-5 / confusion matrix).
"""

from .metrics import Accuracy, confusion_matrix, topk_correct
from .probes import (
    extract_features,
    knn_classify,
    knn_probe_per_layer,
    layer_features,
    linear_probe,
    position_probe,
    subsample_per_class,
)
from .setup import build_mixup, finetune_optimizer, prepare_for_finetune, set_drop_path

__all__ = [
    "Accuracy", "build_mixup", "confusion_matrix", "extract_features", "finetune_optimizer", "knn_classify",
    "knn_probe_per_layer", "layer_features", "linear_probe", "position_probe", "prepare_for_finetune",
    "set_drop_path", "subsample_per_class", "topk_correct",
]
