"""patchplace.export — ONNX export with a PyTorch-vs-ONNX-Runtime parity check (docs/design.md).

``python -m patchplace.export CHECKPOINT --out model.onnx`` or :func:`export_checkpoint`. The ONNX Runtime evaluator
of an exported model (accuracy, consistency, robustness, latency): ``python -m patchplace.export.evaluate``.
"""

from importlib import import_module
from typing import Any

__all__ = ["ExportError", "FeatureExtractor", "SpeechModel", "export_checkpoint", "load_export", "onnx_session",
           "plan_export"]


def __getattr__(name: str) -> Any:
    """The exporter's names, imported on first use (PEP 562): ``python -m patchplace.export --help`` imports no
    torch."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(".exporter", __name__), name)
    globals()[name] = value
    return value
