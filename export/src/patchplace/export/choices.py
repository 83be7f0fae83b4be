"""The export's choices, without torch: what ``python -m patchplace.export --help`` and ``python -m
patchplace.export.evaluate --help`` list (the exporter and the evaluator, which import torch, read them from here)."""

KINDS = ("classifier", "features")  # a classifier graph (logits) or the backbone's pooled features
SPEECH_INPUTS = ("waveform", "features")  # speech graphs: MFCC inside the graph (waveform) or not (features)
DEFAULT_OPSET = 18
# --provider of the evaluator: the execution providers asked for (None: onnx_session's default, CUDA when
# usable, else CPU)
PROVIDERS = {"auto": None, "cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
