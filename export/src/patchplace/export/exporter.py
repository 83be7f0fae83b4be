"""Export a checkpoint to ONNX (DESIGN.md §2 ONNX contract) and check it against PyTorch with ONNX Runtime.

Kinds:

* ``classifier`` — image models take ``pixels (B, C, H, W) float32`` (normalized, as the data path produces) and,
  for MJP models, ``unknown_pos (B, N) bool``; speech models take ``waveform (B, samples)`` with the MFCC frontend
  inside the graph (``speech_input="waveform"``) or ``features (B, T, 40)``. Outputs ``logits`` and ``pooled``
  (the pre-logit features, for MJP's Diff. Norm).
* ``features`` — the backbone as a feature extractor: outputs ``pooled (B, D)`` and ``tokens (B, T, D)``.

The graph written is ONNX Runtime's fused one (:mod:`.optimize`: Attention, BiasGelu) unless the optimizer fails or
its graph misses the tolerance — then the plain one, and the sidecar's ``graph`` says why. Every export is run on
random and (optionally) real inputs through PyTorch and ONNX Runtime; if the max abs difference exceeds the tolerance
(1e-4 fp32, DESIGN §2) the export fails and leaves no file behind. A sidecar
``model.json`` records inputs, outputs, normalization, class names and provenance (checkpoint sha256); the
``.onnx`` file itself carries the same in its ``metadata_props`` (classes, preprocessing steps with their constants,
inputs, outputs, backbone, method, checkpoint sha256), so onnxruntime + numpy alone preprocess correctly.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import onnxscript  # noqa: F401 - torch.onnx.export(dynamo=True) builds the graph with it: a runtime requirement
import torch
from torch import nn

from patchplace.data.mfcc import MFCC
from patchplace.models import Backbone, ModelError, load_pretrained

from .optimize import fusable, optimize_graph

KINDS = ("classifier", "features")
SPEECH_INPUTS = ("waveform", "features")
DEFAULT_OPSET = 18


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked, or the exported graph disagrees with PyTorch."""


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

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.frontend, self.model = MFCC(), model

    def forward(self, waveform: torch.Tensor):
        return self.model(self.frontend(waveform))


@dataclass
class ExportPlan:
    module: nn.Module
    inputs: dict[str, torch.Tensor]  # example inputs, in argument order
    input_specs: list[dict[str, Any]]
    outputs: list[str]


def plan_export(backbone: Backbone, kind: str = "classifier", speech_input: str = "waveform",
                batch: int = 2) -> ExportPlan:
    """Wrap ``backbone`` for ``kind`` and build example inputs and the sidecar's input description."""
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
            module = SpeechModel(module)
            samples = (c.num_frames - 1) * MFCC().hop_length  # center=True: T = 1 + samples // hop
            inputs = {"waveform": torch.randn(batch, samples) * 0.1}
            specs = [{"name": "waveform", "shape": ["batch", samples], "dtype": "float32",
                      "meaning": "16 kHz mono waveform in [-1, 1]"}]
        else:
            inputs = {"features": torch.randn(batch, c.num_frames, c.in_features) * 10}
            specs = [{"name": "features", "shape": ["batch", c.num_frames, c.in_features], "dtype": "float32",
                      "meaning": "MFCC frames (patchplace.data.mfcc.MFCC)"}]
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


def image_preprocessing(backbone: Backbone, metadata: dict[str, Any]) -> dict[str, Any]:
    """How raw uint8 images become the ``pixels`` input, step by step, with the constants — what the evaluation
    path of ``patchplace.data`` does (pad, resize only when the checkpoint trained at another side, scale,
    normalize), written so that numpy alone can reproduce it."""
    c = backbone.config
    height, width = c.image_hw
    norm = metadata.get("normalization") or {"mean": [0.5] * c.in_chans, "std": [0.5] * c.in_chans}
    pad_to, img_size = metadata.get("pad_to"), metadata.get("img_size")
    steps: list[dict[str, Any]] = []
    if pad_to:
        steps.append({"op": "pad", "to": pad_to, "value": 0, "on": "uint8 pixels, (C, h, w)",
                      "placement": "centered: top = (to - h) // 2, left = (to - w) // 2, the rest bottom / right",
                      "when": "h, w <= to (larger images are refused, not cropped)"})
    resize = bool(img_size) and img_size != (pad_to or height)
    if resize:
        steps.append({"op": "resize", "size": img_size, "interpolation": "bicubic", "library": "PIL (timm)",
                      "then": "center crop to size (crop_pct 1.0: no margin)"})
    steps += [{"op": "scale", "divide_by": 255.0, "to": "float32"},
              {"op": "normalize", "mean": list(norm["mean"]), "std": list(norm["std"]),
               "formula": "(x - mean[c]) / std[c] per channel"}]
    return {"input": "pixels", "layout": "NCHW", "dtype": "float32", "channels": c.in_chans, "height": height,
            "width": width, "steps": steps, "mean": list(norm["mean"]), "std": list(norm["std"]),
            "pad_to": pad_to, "pad_value": 0, "interpolation": "bicubic" if resize else "none (no resize)",
            "crop": "center, crop_pct 1.0" if resize else "none"}


def model_properties(sidecar: dict[str, Any], preprocessing: dict[str, Any] | None) -> dict[str, str]:
    """ONNX ``metadata_props`` (strings; JSON where structured): what a user with only onnxruntime + numpy needs —
    class names, the preprocessing, the inputs and outputs — and where the model came from."""
    props = {"patchplace.format": sidecar["format"], "kind": sidecar["kind"], "modality": sidecar["modality"],
             "classes": json.dumps(sidecar["classes"]), "inputs": json.dumps(sidecar["inputs"]),
             "outputs": json.dumps(OUTPUT_MEANING[sidecar["kind"]]), "backbone": json.dumps(sidecar["backbone"]),
             "method": str(sidecar["provenance"]["method"]),
             "checkpoint_sha256": sidecar["provenance"]["checkpoint_sha256"], "graph": json.dumps(sidecar["graph"])}
    if preprocessing is not None:
        props["preprocessing"] = json.dumps(preprocessing)
    return props


OUTPUT_MEANING = {
    "classifier": {"logits": "(batch, classes) scores; argmax indexes `classes`",
                   "pooled": "(batch, dim) the feature the head reads (final-normed CLS or patch mean)"},
    "features": {"pooled": "(batch, dim) the backbone's pooled feature", "tokens": "(batch, tokens, dim)"},
}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


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
        raise ExportError(f"{path} is not a loadable ONNX model ({exc})") from exc


def max_abs_diff(module: nn.Module, session: ort.InferenceSession, inputs: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        expected = module(*inputs.values())
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    return max(float(np.abs(g - e.numpy()).max()) for g, e in zip(got, expected, strict=True))


def parity_checks(graph: onnx.ModelProto, path: Path, plan: ExportPlan, batch_5: dict[str, torch.Tensor],
                  real_inputs: list[dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
    """Max abs difference between PyTorch (``plan.module``) and ``graph`` (saved to ``path``) under ONNX Runtime's
    CPU provider on random inputs at batch 2 and 5 and on the real inputs."""
    onnx.save(graph, str(path))
    session = onnx_session(path, ["CPUExecutionProvider"])
    checks = {"random_batch_2": max_abs_diff(plan.module, session, plan.inputs),
              "random_batch_5": max_abs_diff(plan.module, session, batch_5)}
    for i, inputs in enumerate(real_inputs or []):
        feed = {k: v for k, v in inputs.items() if not k.startswith("_")}  # "_labels" ride along
        if list(feed) != list(plan.inputs):
            raise ExportError(f"real inputs {list(feed)} do not match the model's inputs {list(plan.inputs)}")
        checks[f"real_{i}"] = max_abs_diff(plan.module, session, feed)
    return checks


def optimized_or_not(graph: onnx.ModelProto, backbone: Backbone, tolerance: float,
                     parity: Callable[[onnx.ModelProto], dict[str, float]]
                     ) -> tuple[onnx.ModelProto, dict[str, float] | None, dict[str, Any]]:
    """ONNX Runtime's transformer optimization of ``graph`` with its parity checks and what was fused, or — when the
    optimizer fails, fuses nothing or the result disagrees with PyTorch — ``graph`` itself, no checks, and why."""
    try:
        optimized, fusion = optimize_graph(graph, backbone.config.num_heads, backbone.config.embed_dim)
    except Exception as exc:  # the optimizer fails on graphs it does not know with any exception type
        return graph, None, {"optimized": False, "reason": f"ONNX Runtime's optimizer failed ({type(exc).__name__}: "
                                                           f"{exc})"}
    if not fusion["fused"]:
        return graph, None, {"optimized": False, "reason": "ONNX Runtime's optimizer fused nothing"}
    checks = parity(optimized)
    if max(checks.values()) > tolerance:
        return graph, None, {"optimized": False, "reason": f"the optimized graph disagrees with PyTorch by "
                                                           f"{max(checks.values()):.2e}"}
    depth, attentions = backbone.config.depth, fusion["fused"].get("Attention", 0)
    if attentions < depth:  # relbias2d: ORT's attention fusion takes no additive bias
        fusion = {**fusion, "attention_unfused": f"{depth - attentions} of {depth}"}
    return optimized, checks, {"optimized": True, "optimizer": f"onnxruntime.transformers {ort.__version__} (vit)",
                               **fusion}


def describe_graph(info: dict[str, Any]) -> str:
    """One line for the export log: which graph was written."""
    if not info["optimized"]:
        return f"graph: not optimized, {info['reason']}"
    fused = ", ".join(f"{op} x{n}" for op, n in info["fused"].items())
    unfused = f"; attention not fused in {info['attention_unfused']} blocks" if "attention_unfused" in info else ""
    return (f"graph: ONNX Runtime-optimized ({fused}; {info['skip_layer_norms_split']} SkipLayerNormalization "
            f"split into Add + LayerNormalization{unfused})")


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, *, kind: str = "classifier",
                      speech_input: str = "waveform", opset: int = DEFAULT_OPSET, tolerance: float = 1e-4,
                      real_inputs: list[dict[str, torch.Tensor]] | None = None,
                      img_size: int | None = None, optimize: bool = True) -> dict[str, Any]:
    """Export ``checkpoint`` to ``out`` (model.onnx) + ``out`` with .json (sidecar); returns the sidecar dict.
    ``img_size``: export for another image side than the checkpoint's (same patch size; the PE is resampled,
    ``Backbone.set_image_size``), e.g. a model fine-tuned at 32 px served at 48 px.
    ``optimize``: write ONNX Runtime's fused graph (:mod:`.optimize`; com.microsoft Attention / BiasGelu, so it
    needs ONNX Runtime) when it passes the parity check, else the plain graph — the sidecar's ``graph`` says which
    and why; ``False``: the plain standard-ONNX graph of the training model's own attention.

    Raises :class:`ExportError` (and writes nothing) when the parity check fails."""
    checkpoint, out = Path(checkpoint), Path(out)
    try:
        backbone, metadata = load_pretrained(checkpoint)
        if img_size is not None:
            backbone.set_image_size(img_size)
            metadata = {**metadata, "img_size": img_size}
    except ModelError as exc:
        raise ExportError(str(exc)) from exc
    plan = plan_export(backbone.eval(), kind, speech_input)
    batch = torch.export.Dim("batch", min=1, max=4096)
    dynamic = {name: {0: batch} for name in plan.inputs}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        tmp_model = Path(tmp) / out.name
        # dynamo=True: the maintained exporter (the TorchScript one is deprecated since torch 2.9).
        torch.onnx.export(fusable(plan.module) if optimize else plan.module, tuple(plan.inputs.values()),
                          str(tmp_model), dynamo=True, opset_version=opset, input_names=list(plan.inputs),
                          output_names=plan.outputs, dynamic_shapes=tuple(dynamic.values()), external_data=False,
                          verbose=False)
        graph = onnx.load(str(tmp_model))
        onnx.checker.check_model(graph, full_check=True)
        batch_5 = plan_export(backbone, kind, speech_input, batch=5).inputs
        parity = partial(parity_checks, path=tmp_model, plan=plan, batch_5=batch_5, real_inputs=real_inputs)
        checks, info = None, {"optimized": False, "reason": "not asked (optimize=False)"}
        if optimize:
            graph, checks, info = optimized_or_not(graph, backbone, tolerance, parity)
        checks = checks or parity(graph)
        worst = max(checks.values())
        if worst > tolerance:
            raise ExportError(f"ONNX Runtime disagrees with PyTorch by {worst:.2e} (> {tolerance:.0e}) on "
                              f"{max(checks, key=checks.get)}; nothing was written")
        sidecar = {
            "format": "patchplace.export/1", "kind": kind, "modality": backbone.config.modality,
            "inputs": plan.input_specs, "outputs": plan.outputs, "opset": opset, "graph": info,
            "classes": metadata.get("classes"), "normalization": metadata.get("normalization"),
            "pad_to": metadata.get("pad_to"), "backbone": backbone.config.to_dict(),
            "parity": {"max_abs_diff": checks, "tolerance": tolerance},
            "provenance": {"checkpoint": str(checkpoint.resolve()), "method": metadata.get("method"),
                           "checkpoint_sha256": _sha256(checkpoint / "model.safetensors"),
                           "data": metadata.get("data")},
        }
        if backbone.config.modality == "image":
            sidecar["preprocessing"] = image_preprocessing(backbone, metadata)
        onnx.helper.set_model_props(graph, model_properties(sidecar, sidecar.get("preprocessing")))
        onnx.save(graph, str(tmp_model))  # the same graph, now self-describing
        tmp_json = Path(tmp) / "model.json"
        tmp_json.write_text(json.dumps(sidecar, indent=2) + "\n")
        os.replace(tmp_model, out)
        os.replace(tmp_json, out.with_suffix(".json"))
    return sidecar


def quantize_int8(path: str | os.PathLike) -> Path:
    """int8 dynamic quantization (onnxruntime.quantization, int8 weights per output channel) of the exported
    ``path`` into ``path`` with suffix ``.int8.onnx``, its metadata_props kept; -> that path."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = Path(path)
    out = path.with_suffix(".int8.onnx")
    model = onnx.load(str(path))
    del model.graph.value_info[:]  # the dynamo exporter's value_info trips ORT's shape re-inference; drop it
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(model, f"{tmp}/model.onnx")
        # DefaultTensorType: shape inference gives no type past the com.microsoft ops of an optimized graph
        quantize_dynamic(f"{tmp}/model.onnx", str(out), weight_type=QuantType.QInt8, per_channel=True,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    quantized = onnx.load(str(out))
    onnx.helper.set_model_props(quantized, {**{p.key: p.value for p in model.metadata_props},
                                            "quantization": "int8 dynamic (per-channel int8 weights)"})
    onnx.save(quantized, str(out))
    return out
