"""patchplace.export — ONNX export with a PyTorch-vs-ONNX-Runtime parity check (docs/design.md).

``python -m patchplace.export CHECKPOINT --out model.onnx`` or :func:`export_checkpoint`. The ONNX Runtime evaluator
of an exported model (accuracy, consistency, robustness, latency): ``python -m patchplace.export.evaluate``.
"""

from .exporter import (
    ExportError,
    FeatureExtractor,
    SpeechModel,
    export_checkpoint,
    load_export,
    onnx_session,
    plan_export,
)

__all__ = ["ExportError", "FeatureExtractor", "SpeechModel", "export_checkpoint", "load_export", "onnx_session",
           "plan_export"]
