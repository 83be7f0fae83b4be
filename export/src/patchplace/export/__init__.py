"""patchplace.export.

ONNX export with a PyTorch-vs-ONNX-Runtime parity check, and the ONNX Runtime evaluator (accuracy, MJP consistency /
Diff. Norm, corruption robustness, latency).

The implementation lands with a later issue; this portion of the namespace exists so the layout is stable.
"""
