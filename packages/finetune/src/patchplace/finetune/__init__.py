"""patchplace.finetune.

Fine-tuning and probing: head attach/replace, PE-mode swap keeping the other weights, layer-wise lr-decay groups,
linear / layer-wise kNN / position probes, metrics.

The implementation lands with a later issue; this portion of the namespace exists so the layout is stable.
"""
