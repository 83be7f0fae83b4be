"""patchplace.finetune — heads, PE swap, layer-wise lr decay, mixup/cutmix, and frozen-backbone probes.

Fine-tuning: :func:`prepare_for_finetune` (fresh head, optional PE-mode swap keeping every other weight, drop
path), :func:`build_optimizer` / :func:`finetune_optimizer` (timm AdamW on the model's parameter groups, layer-wise lr
decay applied to each group's lr), :func:`parameter_groups`, :func:`build_mixup` (timm).
Probes: :func:`linear_probe`, :func:`knn_probe_per_layer` (MP3 App. C), :func:`position_probe` (DropPos Table 7).
Metrics: :class:`Accuracy` (top-1 / top-5 / confusion matrix); MJP consistency / Diff. Norm
(:func:`consistency_curve`, shared by the PyTorch and ONNX Runtime evaluators).
Privacy (MJP §5.4, Table 5): :func:`privacy_settings` runs settings (a) / (b) / (c) with the APRIL analytic attack
(:func:`analytic_attack`) and a gradient-matching attack (:func:`gradient_matching_attack`) on the gradients a client
shares (:func:`client_gradients`); :func:`image_similarity` gives MSE / PSNR / SSIM (scikit-image) and FFT2D.
"""

from .consistency import consistency_curve, torch_predict
from .metrics import Accuracy, confusion_matrix, topk_correct
from .privacy import (
    AttackConfig,
    PrivacyError,
    PrivacyResult,
    analytic_attack,
    client_gradients,
    fft2d_similarity,
    gradient_matching_attack,
    image_similarity,
    infer_labels,
    privacy_settings,
    shuffled_positions,
)
from .probes import (
    PROBE_FEATURES,
    embed_tokens,
    extract_features,
    knn_classify,
    knn_probe_per_layer,
    layer_features,
    linear_probe,
    position_probe,
    probe_feature_of,
    subsample_per_class,
)
from .setup import (
    build_mixup,
    build_optimizer,
    finetune_optimizer,
    parameter_groups,
    prepare_for_finetune,
    set_drop_path,
)

__all__ = [
    "PROBE_FEATURES",
    "Accuracy",
    "AttackConfig",
    "PrivacyError",
    "PrivacyResult",
    "analytic_attack",
    "build_mixup",
    "build_optimizer",
    "client_gradients",
    "confusion_matrix",
    "consistency_curve",
    "embed_tokens",
    "extract_features",
    "fft2d_similarity",
    "finetune_optimizer",
    "gradient_matching_attack",
    "image_similarity",
    "infer_labels",
    "knn_classify",
    "knn_probe_per_layer",
    "layer_features",
    "linear_probe",
    "parameter_groups",
    "position_probe",
    "prepare_for_finetune",
    "privacy_settings",
    "probe_feature_of",
    "set_drop_path",
    "shuffled_positions",
    "subsample_per_class",
    "topk_correct",
    "torch_predict",
]
