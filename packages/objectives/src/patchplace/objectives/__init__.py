"""patchplace.objectives — pretraining objectives on the backbone protocol of :mod:`patchplace.models`.

Each objective is an ``nn.Module`` built from ``(backbone, config)``; ``forward(batch, progress)`` returns a dict
with ``loss`` and detached metrics. Progress-dependent schedules take ``progress`` in [0, 1]. Each objective's file
registers the methods it trains (:func:`register_method`, as timm's ``register_model``); :func:`get_method` /
:func:`list_methods` give them to every caller.
"""

import importlib
from typing import Any

from .configs import (
    DropPosConfig,
    IJEPAConfig,
    MAEConfig,
    MJPConfig,
    MP3Config,
    ObjectiveConfig,
    ObjectiveError,
    RandSACConfig,
    SupervisedConfig,
)
from .declarations import known_methods
from .registry import MethodSpec, get_method, list_methods, method_names, register_method, unregister_method

# the names that need torch, by module: imported on first use, so that the configs and registrations above load
# without it (``--help``)
_LAZY = {
    "common": ("TransformerDecoder", "random_masking", "topk_accuracy"),
    "droppos": ("DropPos", "position_accuracy_grid"),
    "ijepa": ("IJEPA",),
    "mae": ("MAE", "patchify", "pixel_targets"),
    "mjp": ("MJP", "DALRegressor", "dal_loss", "jigsaw", "permute_selected"),
    "mp3": ("MP3", "position_accuracy_vs_eta", "reassemble"),
    "randsac": ("RandSAC",),
    "segments": ("blob_segments", "serialize", "square_segments"),
    "supervised": ("Supervised", "classification_loss"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)


__all__ = [
    "IJEPA",
    "MAE",
    "MJP",
    "MP3",
    "DALRegressor",
    "DropPos",
    "DropPosConfig",
    "IJEPAConfig",
    "MAEConfig",
    "MJPConfig",
    "MP3Config",
    "MethodSpec",
    "ObjectiveConfig",
    "ObjectiveError",
    "RandSAC",
    "RandSACConfig",
    "Supervised",
    "SupervisedConfig",
    "TransformerDecoder",
    "blob_segments",
    "classification_loss",
    "dal_loss",
    "get_method",
    "jigsaw",
    "known_methods",
    "list_methods",
    "method_names",
    "patchify",
    "permute_selected",
    "pixel_targets",
    "position_accuracy_grid",
    "position_accuracy_vs_eta",
    "random_masking",
    "reassemble",
    "register_method",
    "serialize",
    "square_segments",
    "topk_accuracy",
    "unregister_method",
]
