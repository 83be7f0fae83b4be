"""patchplace.finetune — heads, PE swap, layer-wise lr decay, mixup/cutmix, and frozen-backbone probes.

Fine-tuning: :func:`prepare_for_finetune` (fresh head, optional PE-mode swap keeping every other weight, drop
path), :func:`build_optimizer` / :func:`finetune_optimizer` (timm AdamW on the model's parameter groups, layer-wise lr
decay applied to each group's lr), :func:`parameter_groups`, :func:`build_mixup` (timm).
Probes: :func:`linear_probe`, :func:`knn_probe_per_layer` (MP3 App. C), :func:`position_probe` (DropPos Table 7).
Streamed probes (split-size-independent memory, the same numbers on 1 or N processes): :class:`FeatureWriter` /
:func:`merge_parts` / :class:`FeatureStore` keep a split's features on disk (:func:`pooled_features`: last layer,
last-4 concatenation, every block); :class:`ProbeRecipe` + :func:`train_probe` are the papers' linear-probe
protocols (MAE / RandSAC LARS, StoP / I-JEPA VISSL SGD), :func:`logistic_regression` StoP's 1% probe,
:func:`knn_vote_counts` the chunked kNN; :func:`match_subset` reads ImageNet 1% / 10% subset lists.
Metrics: :class:`Accuracy` (top-1 / top-5 / confusion matrix); MJP consistency / Diff. Norm
(:func:`consistency_curve`, shared by the PyTorch and ONNX Runtime evaluators).
Privacy (MJP §5.4, Table 5): :func:`privacy_settings` runs settings (a) / (b) / (c) with the APRIL analytic attack
(:func:`analytic_attack`) and a gradient-matching attack (:func:`gradient_matching_attack`) on the gradients a client
shares (:func:`client_gradients`); :func:`image_similarity` gives MSE / PSNR / SSIM (scikit-image) and FFT2D.
"""

from .consistency import consistency_curve, torch_predict
from .feature_store import (
    LAST_LAYERS,
    FeatureStore,
    FeatureWriter,
    StoreError,
    feature_names,
    last_layers,
    match_subset,
    merge_parts,
    pooled_features,
    read_subset_file,
)
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
from .probe_recipes import (
    LogisticModel,
    ProbeRecipe,
    knn_vote_counts,
    logistic_regression,
    score,
    standardization,
    train_probe,
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
    "LAST_LAYERS",
    "PROBE_FEATURES",
    "Accuracy",
    "AttackConfig",
    "FeatureStore",
    "FeatureWriter",
    "LogisticModel",
    "PrivacyError",
    "PrivacyResult",
    "ProbeRecipe",
    "StoreError",
    "analytic_attack",
    "build_mixup",
    "build_optimizer",
    "client_gradients",
    "confusion_matrix",
    "consistency_curve",
    "embed_tokens",
    "extract_features",
    "feature_names",
    "fft2d_similarity",
    "finetune_optimizer",
    "gradient_matching_attack",
    "image_similarity",
    "infer_labels",
    "knn_classify",
    "knn_probe_per_layer",
    "knn_vote_counts",
    "last_layers",
    "layer_features",
    "linear_probe",
    "logistic_regression",
    "match_subset",
    "merge_parts",
    "parameter_groups",
    "pooled_features",
    "position_probe",
    "prepare_for_finetune",
    "privacy_settings",
    "probe_feature_of",
    "read_subset_file",
    "score",
    "set_drop_path",
    "shuffled_positions",
    "standardization",
    "subsample_per_class",
    "topk_correct",
    "torch_predict",
    "train_probe",
]
