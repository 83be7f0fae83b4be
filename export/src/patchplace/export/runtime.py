"""ONNX Runtime, imported once with the fix for a missing install, and the session every check and evaluation
runs on."""

from __future__ import annotations

import os

import torch

try:
    import onnxruntime as ort
except ImportError as exc:  # an extra, so that one runtime is installed, never both
    raise ImportError("patchplace.export needs ONNX Runtime: pip install 'patchplace-export[cpu]' (onnxruntime) or "
                      "'patchplace-export[gpu]' (onnxruntime-gpu), not both") from exc

from .errors import ExportError


def onnx_session(path: str | os.PathLike, providers: list[str] | None = None,
                 threads: int = 0) -> ort.InferenceSession:
    """An ONNX Runtime session on CUDA when available, else CPU: every graph optimization (ORT_ENABLE_ALL) except
    SkipLayerNormFusion on the CPU (see :mod:`.optimize`: its kernel is ~10x slower than LayerNormalization there);
    ``threads``: intra-op threads (0: ONNX Runtime's default, one per physical core)."""
    available = ort.get_available_providers()
    wanted = ("CUDAExecutionProvider", "CPUExecutionProvider") if torch.cuda.is_available() else (
        "CPUExecutionProvider",)  # onnxruntime-gpu lists CUDA even where no GPU / CUDA libraries exist
    chosen = providers or [p for p in wanted if p in available]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    disabled = [] if "CUDAExecutionProvider" in chosen else ["SkipLayerNormFusion"]
    try:
        return ort.InferenceSession(str(path), options, providers=chosen, disabled_optimizers=disabled)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"{path} is not a loadable ONNX model ({' '.join(str(exc).split())})") from exc
