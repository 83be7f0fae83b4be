"""patchplace.objectives.

The pretraining objectives — MP3 (vision and speech), DropPos, I-JEPA + StoP, Masked Jigsaw Puzzle, RandSAC — and
the MAE and supervised baselines, each one readable module on the backbone protocol of patchplace.models.

The implementation lands with a later issue; this portion of the namespace exists so the layout is stable.
"""
