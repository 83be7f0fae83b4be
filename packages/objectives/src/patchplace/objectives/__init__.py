"""patchplace.objectives — pretraining objectives on the backbone protocol of :mod:`patchplace.models`.

Each objective is an ``nn.Module`` built from ``(backbone, config)``; ``forward(batch, progress)`` returns a dict
with ``loss`` and detached metrics. Progress-dependent schedules take ``progress`` in [0, 1].
"""

from .common import ObjectiveConfig, ObjectiveError, TransformerDecoder, random_masking, topk_accuracy
from .droppos import DropPos, DropPosConfig, position_accuracy_grid
from .ijepa import IJEPA, IJEPAConfig
from .mae import MAE, MAEConfig, patchify
from .mp3 import MP3, MP3Config, position_accuracy_vs_eta, reassemble
from .supervised import Supervised, SupervisedConfig

__all__ = [
    "IJEPA",
    "MAE",
    "MP3",
    "DropPos",
    "DropPosConfig",
    "IJEPAConfig",
    "MAEConfig",
    "MP3Config",
    "ObjectiveConfig",
    "ObjectiveError",
    "Supervised",
    "SupervisedConfig",
    "TransformerDecoder",
    "patchify",
    "position_accuracy_grid",
    "position_accuracy_vs_eta",
    "random_masking",
    "reassemble",
    "topk_accuracy",
]
