"""patchplace.objectives — pretraining objectives on the backbone protocol of :mod:`patchplace.models`.

Each objective is an ``nn.Module`` built from ``(backbone, config)``; ``forward(batch, progress)`` returns a dict
with ``loss`` and detached metrics. Progress-dependent schedules take ``progress`` in [0, 1]. Each objective's file
registers the methods it trains (:func:`register_method`, as timm's ``register_model``); :func:`get_method` /
:func:`list_methods` give them to every caller.
"""

from .common import ObjectiveConfig, ObjectiveError, TransformerDecoder, random_masking, topk_accuracy
from .droppos import DropPos, DropPosConfig, position_accuracy_grid
from .ijepa import IJEPA, IJEPAConfig
from .mae import MAE, MAEConfig, patchify, pixel_targets
from .mjp import MJP, DALRegressor, MJPConfig, dal_loss, jigsaw, permute_selected
from .mp3 import MP3, MP3Config, position_accuracy_vs_eta, reassemble
from .randsac import RandSAC, RandSACConfig
from .registry import MethodSpec, get_method, list_methods, method_names, register_method, unregister_method
from .segments import blob_segments, serialize, square_segments
from .supervised import Supervised, SupervisedConfig, classification_loss

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
