"""patchplace.export — ONNX export with a PyTorch-vs-ONNX-Runtime parity check (docs/design.md).

``python -m patchplace.export CHECKPOINT --out model.onnx`` or :func:`export_checkpoint`. The ONNX Runtime evaluator
(accuracy, consistency, robustness, latency) is the rest of issue 7.
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
