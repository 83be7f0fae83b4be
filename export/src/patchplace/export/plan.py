"""What is traced: the backbone wrapped for the export's kind (classifier, feature extractor, the MFCC front end
of a speech model), its example inputs and the sidecar's description of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchplace.data.mfcc import MFCC, build_frontend
from patchplace.models import Backbone

from .choices import KINDS, SPEECH_INPUTS
from .errors import ExportError


class Classifier(nn.Module):
    """Backbone -> (logits, pooled): the pooled features (final-normed CLS or mean) give MJP's Diff. Norm."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor, unknown_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.backbone.forward_head(self.backbone.forward_features(x, unknown_pos), pre_logits=True)
        return self.backbone.head(pooled), pooled


class FeatureExtractor(nn.Module):
    """Backbone -> (pooled, tokens) for downstream use."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.backbone.forward_features(x)
        return self.backbone.forward_head(tokens, pre_logits=True), tokens


class SpeechModel(nn.Module):
    """MFCC frontend + speech backbone (classifier or feature extractor) on raw 16 kHz waveforms."""

    def __init__(self, model: nn.Module, frontend: str | None = None) -> None:
        super().__init__()
        self.frontend, self.model = build_frontend(frontend), model  # the front end the checkpoint trained on

    def forward(self, waveform: torch.Tensor):
        return self.model(self.frontend(waveform))


@dataclass
class ExportPlan:
    module: nn.Module
    inputs: dict[str, torch.Tensor]  # example inputs, in argument order
    input_specs: list[dict[str, Any]]
    outputs: list[str]


def clip_samples(frontend: MFCC, frames: int) -> int:
    """The waveform length the speech front end turns into ``frames`` frames (1 s at 16 kHz for every shipped
    front end: 101 centred frames, 100 padded TC-ResNet frames, 98 unpadded ones)."""
    hop, window = frontend.hop_length, frontend.win_length
    for samples in ((frames - 1) * hop + window, frames * hop, (frames - 1) * hop):
        try:
            if frontend.num_frames(samples) == frames:
                return samples
        except ValueError:  # (too short for this framing)
            continue
    raise ExportError(f"no waveform length gives the backbone's {frames} frames with this front end "
                      f"(framing={frontend.framing}): check the checkpoint's num_frames against its data.frontend")


def plan_export(backbone: Backbone, kind: str = "classifier", speech_input: str = "waveform",
                batch: int = 2, frontend: str | None = None) -> ExportPlan:
    """Wrap ``backbone`` for ``kind`` and build example inputs and the sidecar's input description (speech:
    ``frontend``, the MFCC front end the checkpoint recorded)."""
    if kind not in KINDS or speech_input not in SPEECH_INPUTS:
        raise ExportError(f"kind must be one of {KINDS} and speech_input one of {SPEECH_INPUTS}")
    c = backbone.config
    if kind == "classifier" and c.num_classes < 1:
        raise ExportError("this checkpoint has no classifier head (num_classes = 0): export it with "
                          "--kind features, or fine-tune it first")
    module: nn.Module = Classifier(backbone) if kind == "classifier" else FeatureExtractor(backbone)
    outputs = ["logits", "pooled"] if kind == "classifier" else ["pooled", "tokens"]
    if c.modality == "audio":
        if speech_input == "waveform":
            module = SpeechModel(module, frontend)
            samples = clip_samples(module.frontend, c.num_frames)
            inputs = {"waveform": torch.randn(batch, samples) * 0.1}
            specs = [{"name": "waveform", "shape": ["batch", samples], "dtype": "float32",
                      "meaning": "16 kHz mono waveform in [-1, 1]"}]
        else:
            inputs = {"features": torch.randn(batch, c.num_frames, c.in_features) * 10}
            specs = [{"name": "features", "shape": ["batch", c.num_frames, c.in_features], "dtype": "float32",
                      "meaning": f"MFCC frames (patchplace.data.mfcc front end {frontend or 'tf_speech_commands'})"}]
        return ExportPlan(module.eval(), inputs, specs, outputs)
    h, w = c.image_hw
    inputs = {"pixels": torch.randn(batch, c.in_chans, h, w)}
    specs = [{"name": "pixels", "shape": ["batch", c.in_chans, h, w], "dtype": "float32",
              "meaning": "normalized images ((x / 255 - mean) / std after padding / resizing)"}]
    if c.unknown_pos and kind == "classifier":
        inputs["unknown_pos"] = torch.rand(batch, backbone.num_patches) < 0.15
        specs.append({"name": "unknown_pos", "shape": ["batch", backbone.num_patches], "dtype": "bool",
                      "meaning": "MJP: True where a patch was shuffled (gets the unknown PE)"})
    return ExportPlan(module.eval(), inputs, specs, outputs)
