"""The export's choices, without torch: what ``python -m patchplace.export --help`` lists (the exporter, which
imports torch, reads them from here)."""

KINDS = ("classifier", "features")  # a classifier graph (logits) or the backbone's pooled features
SPEECH_INPUTS = ("waveform", "features")  # speech graphs: MFCC inside the graph (waveform) or not (features)
DEFAULT_OPSET = 18
