"""Export a checkpoint to ONNX (docs/design.md ONNX contract) and check it against PyTorch with ONNX Runtime.

Kinds:

* ``classifier`` — image models take ``pixels (B, C, H, W) float32`` (normalized, as the data path produces) and,
  for MJP models, ``unknown_pos (B, N) bool``; speech models take ``waveform (B, samples)`` with the MFCC frontend
  inside the graph (``speech_input="waveform"``) or ``features (B, T, 40)``. Outputs ``logits`` and ``pooled``
  (the pre-logit features, for MJP's Diff. Norm).
* ``features`` — the backbone as a feature extractor: outputs ``pooled (B, D)`` and ``tokens (B, T, D)``.

The graph written is ONNX Runtime's fused one (:mod:`.optimize`: Attention, BiasGelu) unless the optimizer fails or
its graph misses the tolerance — then the plain one, and the sidecar's ``graph`` says why. Every export is run on
random and (optionally) real inputs through PyTorch and ONNX Runtime; if the max abs difference exceeds the tolerance
(1e-4 fp32, docs/design.md) - or is NaN: non-finite weights, outputs or differences fail every gate — the export
fails and leaves no file behind. A sidecar ``model.json`` records inputs, outputs, normalization, class names and
provenance (checkpoint sha256); the ``.onnx`` file itself carries the same in its ``metadata_props`` (classes,
preprocessing steps with their constants, inputs, outputs, backbone, method, checkpoint sha256), so onnxruntime +
numpy alone preprocess correctly.

The pair is bound: both carry one ``export_id`` and the sidecar records the ``.onnx`` file's sha256, so
:func:`load_export` refuses a model.onnx beside another export's model.json (or changed since). The commit
(:func:`write_pair`) removes the old sidecar first and renames the new one into place last; temporary directories of
killed exports are removed by the next export to the same path (:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx

try:
    import onnxruntime as ort
except ImportError as exc:  # an extra, so that one runtime is installed, never both
    raise ImportError("patchplace.export needs ONNX Runtime: pip install 'patchplace-export[cpu]' (onnxruntime) or "
                      "'patchplace-export[gpu]' (onnxruntime-gpu), not both") from exc
import onnxscript  # noqa: F401 - torch.onnx.export(dynamo=True) builds the graph with it: a runtime requirement
import torch
from torch import nn

from patchplace.data.atomic import path_problem
from patchplace.data.manifest import sha256_file
from patchplace.data.mfcc import MFCC, build_frontend
from patchplace.models import Backbone, ModelError, load_pretrained

from .choices import DEFAULT_OPSET, KINDS, SPEECH_INPUTS
from .optimize import fusable, optimize_graph


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked, or the exported graph disagrees with PyTorch."""


class Unavailable(ExportError):
    """An optional part of an evaluation cannot run here (a missing extra, images it cannot take): the evaluator
    skips it, says why and how to get it, and keeps what the other parts measured."""


def non_finite(values: np.ndarray | torch.Tensor) -> str:
    """What in ``values`` is not finite: "NaN", "inf", "NaN and inf" — or "" when everything is finite."""
    values = torch.as_tensor(values)
    if not values.is_floating_point() or bool(torch.isfinite(values).all()):
        return ""
    return " and ".join(k for k, bad in (("NaN", torch.isnan(values).any()), ("inf", torch.isinf(values).any()))
                        if bool(bad))


DIVERGED = "the training that wrote it diverged; use an earlier checkpoint, or train again with a lower optim.lr"


def check_finite_weights(backbone: Backbone, checkpoint: Path) -> None:
    """Refuse a checkpoint any of whose weights (parameters and buffers, after ``set_image_size``) is NaN or
    infinite (``load_pretrained`` may refuse it first, with the same advice)."""
    state = backbone.state_dict()
    bad = [name for name, tensor in state.items() if non_finite(tensor)]
    if bad:
        kinds = " and ".join(sorted({k for name in bad for k in non_finite(state[name]).split(" and ")}))
        raise ExportError(f"{checkpoint} holds non-finite weights ({kinds} in {len(bad)} tensor(s), e.g. {bad[0]}): "
                          f"{DIVERGED}; nothing was written")


def worst_check(checks: dict[str, float]) -> tuple[str, float]:
    """(name, value) of the largest difference, NaN counting as larger than any number (``max`` would skip it)."""
    name = max(checks, key=lambda k: math.inf if math.isnan(checks[k]) else checks[k])
    return name, checks[name]


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
    record = eval_transform(backbone, metadata)
    crop_pct = record["crop_pct"] if record["mode"] == "resize_center_crop" else 1.0
    kernel = recorded_interpolation(metadata)
    # images of any size (resize_center_crop) always go through the resize and the crop (no-ops at the input's
    # size); padded ones only when the checkpoint trained at another side than the padding's
    resize = record["mode"] == "resize_center_crop" or (bool(img_size) and img_size != (pad_to or height))
    if resize:
        short_side = record.get("resize_short_side", math.floor(height / crop_pct))
        steps += [{"op": "resize", "short_side": short_side, "interpolation": kernel, "library": "PIL",
                   "long_side": "int(short_side * long / short) (torchvision Resize(int)); no resize when equal"},
                  {"op": "center_crop", "height": height, "width": width,
                   "placement": "top = int(round((h - height) / 2)), left likewise (torchvision CenterCrop)"}]
    steps += [{"op": "scale", "divide_by": 255.0, "to": "float32"},
              {"op": "normalize", "mean": list(norm["mean"]), "std": list(norm["std"]),
               "formula": "(x - mean[c]) / std[c] per channel"}]
    return {"input": "pixels", "layout": "NCHW", "dtype": "float32", "channels": c.in_chans, "height": height,
            "width": width, "steps": steps, "mean": list(norm["mean"]), "std": list(norm["std"]),
            "pad_to": pad_to, "pad_value": 0, "interpolation": kernel if resize else "none (no resize)",
            "crop": f"center, crop_pct {crop_pct}" if resize else "none", "eval_transform": record}


def recorded_interpolation(metadata: dict[str, Any]) -> str:
    """The interpolation of a checkpoint's evaluation resize: ``metadata.interpolation`` (written where it is not
    bicubic), else its recipe's ``data.interpolation``, else bicubic (timm's default, every checkpoint before the
    field)."""
    recipe_data = ((metadata.get("recipe") or {}).get("data") or {}) if isinstance(metadata.get("recipe"), dict) else {}
    return str(metadata.get("interpolation") or recipe_data.get("interpolation") or "bicubic")


def recorded_crop_pct(metadata: dict[str, Any]) -> tuple[float, str]:
    """(crop_pct, where it came from) of a checkpoint's evaluation transform: ``metadata.crop_pct`` (an export's
    ``crop_pct=`` sets it), else its recipe's ``data.crop_pct``, else 1.0 (timm's resize to the input, no margin)."""
    recipe_data = ((metadata.get("recipe") or {}).get("data") or {}) if isinstance(metadata.get("recipe"), dict) else {}
    for value, source in ((metadata.get("crop_pct"), "checkpoint metadata.crop_pct"),
                          (recipe_data.get("crop_pct"), "checkpoint metadata.recipe.data.crop_pct")):
        if value is not None:
            return float(value), source
    return 1.0, "default (the checkpoint records no crop_pct)"


def eval_transform(backbone: Backbone, metadata: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's evaluation transform of raw images, as ``patchplace.data`` (timm's ``create_transform(
    is_training=False)``) runs it, with every constant the ONNX Runtime evaluator needs to give PyTorch's input
    bit for bit. ``mode`` ``pad``: zero-pad (centered) to ``pad_to`` (larger images are refused, not cropped);
    ``resize_center_crop``: PIL resize with the recorded interpolation (:func:`recorded_interpolation`) of the
    short side to ``floor(size / crop_pct)`` (torchvision's ``Resize(int)``: the long side ``int(short * long /
    short_side)``), center crop to ``size`` (top ``int(round((h - size) / 2))``), /255, normalize; ``timm`` holds
    the keyword arguments of that transform."""
    c = backbone.config
    height, width = c.image_hw
    norm = metadata.get("normalization") or {"mean": [0.5] * c.in_chans, "std": [0.5] * c.in_chans}
    record: dict[str, Any] = {"input_size": [c.in_chans, height, width], "mean": [float(v) for v in norm["mean"]],
                              "std": [float(v) for v in norm["std"]]}
    if metadata.get("pad_to"):
        return {"mode": "pad", "pad_to": int(metadata["pad_to"]), "pad_value": 0, **record,
                "larger_images": "refused (padding never crops)"}
    crop_pct, source = recorded_crop_pct(metadata)
    kernel = recorded_interpolation(metadata)
    if height != width or not 0 < crop_pct <= 1:
        return {"mode": "none", **record, "why": f"no resize record for a {height}x{width} input / crop_pct "
                                                 f"{crop_pct} (square inputs, crop_pct in (0, 1] only)"}
    return {"mode": "resize_center_crop", **record, "crop_pct": crop_pct, "crop_pct_source": source,
            "resize_short_side": math.floor(height / crop_pct), "interpolation": kernel,
            "resize": f"PIL Image.resize({kernel.upper()}) of the short side to resize_short_side, the long side "
                      "int(resize_short_side * long / short) (torchvision Resize(int); no resize when equal)",
            "crop": "center: top = int(round((h - size) / 2)), left = int(round((w - size) / 2)) (Python round)",
            "scale": "x / 255 (float32)", "normalize": "(x - mean[c]) / std[c] (float32)",
            "timm": {"is_training": False, "input_size": [c.in_chans, height, width], "crop_pct": crop_pct,
                     "crop_mode": "center", "interpolation": kernel, "mean": [float(v) for v in norm["mean"]],
                     "std": [float(v) for v in norm["std"]]}}


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


INT8_SUFFIX = ".int8.onnx"
FP16_SUFFIX = ".fp16.onnx"
PROTOBUF_LIMIT = 2**31  # one protobuf message (a .onnx file with its weights inside) holds at most 2 GiB
# weights above this go to an external data file NAME.onnx.data beside NAME.onnx (headroom for the graph itself)
EXTERNAL_DATA_THRESHOLD = PROTOBUF_LIMIT - 2**28


def data_of(model: str | os.PathLike) -> Path:
    """The external data file of ``NAME.onnx`` (models whose weights exceed :data:`EXTERNAL_DATA_THRESHOLD`):
    ``NAME.onnx.data`` beside it, named in the graph relative to it (the pair moves together)."""
    model = Path(model)
    return model.with_name(model.name + ".data")


def weight_bytes(model: onnx.ModelProto | nn.Module) -> int:
    """Bytes of the weights (a module's parameters and buffers, or a graph's initializers) — what decides whether
    the graph is saved with external data."""
    if isinstance(model, nn.Module):
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return sum(len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def save_graph(graph: onnx.ModelProto, path: Path, external: bool) -> None:
    """``onnx.save`` of ``graph`` to ``path``: one file, or (``external``) the graph with its tensors in
    :func:`data_of` ``(path)`` (which is written anew, never appended to). ``graph`` keeps its weights in memory
    (onnx's external-data save moves them out of the proto: they are read back)."""
    data = data_of(path)
    data.unlink(missing_ok=True)
    if not external:
        onnx.save(graph, str(path))
        return
    onnx.save_model(graph, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    from onnx.external_data_helper import load_external_data_for_model

    load_external_data_for_model(graph, str(path.parent))


def sidecar_of(model: str | os.PathLike) -> Path:
    """The sidecar of an exported ``NAME.onnx``: ``NAME.json`` beside it (``model.v1.onnx`` -> ``model.v1.json``),
    the one rule the exporter and every reader use; distinct model names never share a sidecar."""
    model = Path(model)
    stem = model.name[: -len(".onnx")] if model.name.endswith(".onnx") else model.name
    return model.with_name(f"{stem}.json")


def int8_of(model: str | os.PathLike) -> Path:
    """The int8 copy ``--quantize`` writes of ``NAME.onnx``: ``NAME.int8.onnx`` beside it."""
    model = Path(model)
    return model.with_name(sidecar_of(model).name[: -len(".json")] + INT8_SUFFIX)


def fp16_of(model: str | os.PathLike) -> Path:
    """The fp16 copy ``--fp16`` writes of ``NAME.onnx``: ``NAME.fp16.onnx`` beside it."""
    model = Path(model)
    return model.with_name(sidecar_of(model).name[: -len(".json")] + FP16_SUFFIX)


def copy_suffix(path: str | os.PathLike) -> str:
    """``.int8.onnx`` / ``.fp16.onnx`` for a copy the exporter writes beside an export (no sidecar of its own),
    else ""."""
    return next((suffix for suffix in (INT8_SUFFIX, FP16_SUFFIX) if Path(path).name.endswith(suffix)), "")


def fp32_of(copy: str | os.PathLike) -> Path:
    """``NAME.onnx``, the exported model whose int8 / fp16 copy is ``NAME.int8.onnx`` / ``NAME.fp16.onnx``."""
    copy = Path(copy)
    return copy.with_name(copy.name[: -len(copy_suffix(copy) or ".onnx")] + ".onnx")


def check_writable(directory: Path, what: str) -> None:
    """Refuse, before any work, a ``directory`` to write into that cannot be: under a file, or in a place this
    process may not create files (read-only file system, permissions: tried by creating and removing a file in the
    nearest existing ancestor, which creates nothing that stays)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ExportError(f"{what}: {probe} is a file, not a directory: choose a path in a directory")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".patchplace-write-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise ExportError(f"{what}: cannot create files in {probe} ({exc.strerror or exc}): choose a writable "
                          "directory") from None


def check_out(out: str | os.PathLike) -> Path:
    """Refuse, before any work, an export ``--out`` that could not be committed: not named ``NAME.onnx`` (the
    sidecar ``NAME.json`` and the int8 copy ``NAME.int8.onnx`` are named from it), an int8 copy's name, a directory
    where the model, its sidecar or its int8 copy go, or a place that cannot be written. -> ``out`` as a Path."""
    out = Path(out)
    if problem := path_problem("--out", out):
        raise ExportError(problem)
    if not out.name.endswith(".onnx") or out.name == ".onnx":
        raise ExportError(f"--out {out}: name the model NAME.onnx (e.g. --out {out.with_name(out.name + '.onnx')}"
                          f"): its sidecar NAME.json and int8 copy NAME.int8.onnx are named from it")
    if suffix := copy_suffix(out):
        kind, flag = ("int8", "--quantize") if suffix == INT8_SUFFIX else ("fp16", "--fp16")
        raise ExportError(f"--out {out}: NAME{suffix} is the name of the {kind} copy {flag} writes of NAME.onnx; "
                          f"choose another name (e.g. --out {fp32_of(out)} {flag})")
    for path in (out, sidecar_of(out), int8_of(out), fp16_of(out)):
        if path.is_dir():
            raise ExportError(f"--out {out}: {path} is a directory: give the model file's path, e.g. --out "
                              f"{out / 'model.onnx'}" if path == out else
                              f"--out {out}: {path} is a directory where the export writes a file: remove it")
    check_writable(out.parent, f"--out {out}")
    return out


def load_export(path: str | os.PathLike, providers: list[str] | None = None,
                threads: int = 0) -> tuple[dict[str, Any], ort.InferenceSession]:
    """(sidecar, session) of an exported ``model.onnx`` after checking that its ``model.json`` belongs to it: one
    export id and one checkpoint in both, and the ``.onnx`` file's sha256 the one the sidecar recorded. Exports
    written before the binding (no id in either) are checked by their checkpoint sha256 only."""
    path = Path(path)
    if suffix := copy_suffix(path):
        kind, flag = ("int8", "--quantize") if suffix == INT8_SUFFIX else ("fp16", "--fp16")
        raise ExportError(f"{path} is the {kind} copy of {fp32_of(path)} (written by python -m patchplace.export "
                          f"{flag}), not an exported pair: load {fp32_of(path)}; the export's report "
                          f"({flag} --data SPLIT) gives the {kind} model's parity and top-1 change")
    sidecar_path = sidecar_of(path)
    rerun = f"re-run the export (python -m patchplace.export CHECKPOINT --out {path})"
    if path.suffix != ".onnx" or not path.is_file():
        raise ExportError(f"{path} is not an exported model: expected a .onnx file written by "
                          f"python -m patchplace.export CHECKPOINT --out {path}")
    if not sidecar_path.is_file():
        raise ExportError(f"{path} is not an exported model: no {sidecar_path.name} beside it (an interrupted export "
                          f"leaves none); {rerun}")
    try:
        sidecar = json.loads(sidecar_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{sidecar_path} is not valid JSON ({exc}): damaged; {rerun}") from None
    if not isinstance(sidecar, dict):
        raise ExportError(f"{sidecar_path} is not an export sidecar (a JSON object): damaged; {rerun}")
    if external := sidecar.get("external_data"):  # the weights of a graph over 2 GiB, beside it
        data = path.with_name(external["file"])
        if not data.is_file():
            raise ExportError(f"{path} keeps its weights in {data.name} beside it, which is missing (copy both "
                              f"files together); {rerun}")
        if "sha256" in external and (data.stat().st_size != external.get("bytes")
                                     or sha256_file(data) != external["sha256"]):
            raise ExportError(f"{data} is not the weights file of {path} (its size or sha256 is not the one "
                              f"{sidecar_path.name} records): damaged or another export's; {rerun}")
    session = onnx_session(path, providers, threads)
    props = session.get_modelmeta().custom_metadata_map
    ids = props.get("export_id"), sidecar.get("export_id")
    checkpoints = props.get("checkpoint_sha256"), (sidecar.get("provenance") or {}).get("checkpoint_sha256")
    if ids[0] != ids[1] or checkpoints[0] != checkpoints[1]:
        raise ExportError(f"{path} and {sidecar_path.name} come from different exports (export id {ids[0]} vs "
                          f"{ids[1]}; an export interrupted between its renames, or one file copied over the "
                          f"other): {rerun}")
    if "onnx_sha256" in sidecar and sidecar["onnx_sha256"] != sha256_file(path):
        raise ExportError(f"{path} changed after its export (its sha256 is not the one {sidecar_path.name} "
                          f"records): damaged or edited; {rerun}")
    if problem := sidecar_problem(sidecar, props):
        raise ExportError(f"{sidecar_path}: {problem}: the sidecar was edited after its export, and its numbers "
                          f"would not be the model's; {rerun}")
    return sidecar, session


SIDECAR_PROPS = ("kind", "modality", "classes", "inputs", "backbone", "preprocessing", "graph")  # JSON in both


def sidecar_problem(sidecar: dict[str, Any], props: dict[str, str]) -> str:
    """What in a sidecar disagrees with the ``.onnx`` file's own ``metadata_props`` (written from the same dict at
    export: the graph's sha256 binds them, not the sidecar's) or with itself — "" when nothing does. Every field
    the evaluator reads is checked: the preprocessing (crop_pct, resize side, mean / std, padding), classes,
    inputs, backbone."""
    for key in SIDECAR_PROPS:
        if key not in props:  # exports from before the field was written
            continue
        recorded = props[key] if key in ("kind", "modality") else json.loads(props[key])
        if where := first_difference(sidecar.get(key), recorded, key):
            return f"{where[0]} is {json.dumps(where[1])} but the .onnx file's metadata says {json.dumps(where[2])}"
    return consistency_problem(sidecar)


def first_difference(ours: Any, theirs: Any, path: str) -> tuple[str, Any, Any] | None:
    """(dotted path, our value, theirs) of the first place two JSON values differ, else None."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in [*theirs, *(k for k in ours if k not in theirs)]:
            if found := first_difference(ours.get(key), theirs.get(key), f"{path}.{key}"):
                return found
        return None
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if found := first_difference(a, b, f"{path}[{i}]"):
                return found
        return None
    return None if ours == theirs else (path, ours, theirs)


def consistency_problem(sidecar: dict[str, Any]) -> str:
    """What in an image sidecar contradicts itself: its evaluation transform's ``resize_short_side`` against
    ``floor(size / crop_pct)``, ``timm.crop_pct``, the resize step and the input size, its interpolation against
    ``timm.interpolation`` and the resize step's; ``normalization`` and
    ``pad_to`` against the preprocessing's. "" when all agree."""
    pre = sidecar.get("preprocessing") or {}
    record = pre.get("eval_transform") or {}
    norm = sidecar.get("normalization")
    for key in ("mean", "std"):
        if norm and key in pre and list(norm.get(key) or []) != list(pre[key]):
            return f"normalization.{key} is {norm.get(key)} but preprocessing.{key} is {pre[key]}"
    if "pad_to" in pre and sidecar.get("pad_to") != pre["pad_to"]:
        return f"pad_to is {sidecar.get('pad_to')} but preprocessing.pad_to is {pre['pad_to']}"
    if record.get("mode") != "resize_center_crop":
        return ""
    crop_pct, side = record.get("crop_pct"), record.get("resize_short_side")
    size = (record.get("input_size") or [0])[-1]
    if not isinstance(crop_pct, (int, float)) or not 0 < crop_pct <= 1:
        return f"preprocessing.eval_transform.crop_pct is {crop_pct}, not a number in (0, 1]"
    if side != math.floor(size / crop_pct):
        return (f"preprocessing.eval_transform.resize_short_side is {side} but its crop_pct {crop_pct} at size {size} "
                f"gives floor({size} / {crop_pct}) = {math.floor(size / crop_pct)}")
    if (record.get("timm") or {}).get("crop_pct", crop_pct) != crop_pct:
        return (f"preprocessing.eval_transform.timm.crop_pct is {record['timm']['crop_pct']} but its crop_pct is "
                f"{crop_pct}")
    kernel = record.get("interpolation", "bicubic")
    if (record.get("timm") or {}).get("interpolation", kernel) != kernel:
        return (f"preprocessing.eval_transform.timm.interpolation is {record['timm']['interpolation']} but its "
                f"interpolation is {kernel}")
    for step in pre.get("steps") or []:
        if step.get("op") == "resize" and step.get("short_side", step.get("size")) != side:
            return (f"the resize step's short_side is {step.get('short_side', step.get('size'))} but "
                    f"preprocessing.eval_transform.resize_short_side is {side}")
        if step.get("op") == "resize" and step.get("interpolation", "bicubic") != kernel:
            return (f"the resize step's interpolation is {step.get('interpolation', 'bicubic')} but "
                    f"preprocessing.eval_transform.interpolation is {kernel}")
    inputs = sidecar.get("inputs") or [{}]
    if list(inputs[0].get("shape") or [])[1:] != list(record.get("input_size") or []):
        return (f"inputs[0].shape is {inputs[0].get('shape')} but preprocessing.eval_transform.input_size is "
                f"{record.get('input_size')}")
    return ""


def max_abs_diff(module: nn.Module, session: ort.InferenceSession, inputs: dict[str, torch.Tensor],
                 label: str = "these inputs") -> float:
    """Max abs difference of ``session``'s outputs from ``module``'s — NaN when ONNX Runtime's are non-finite where
    PyTorch's are not; raises :class:`ExportError` when PyTorch's are non-finite (the checkpoint, not the graph)."""
    with torch.no_grad():
        expected = module(*inputs.values())
    expected = expected if isinstance(expected, tuple) else (expected,)
    for name, value in zip(session.get_outputs(), expected, strict=True):
        if kind := non_finite(value):
            raise ExportError(f"PyTorch's {name.name} output holds {kind} on {label} although its weights are "
                              f"finite (float32 overflow): {DIVERGED}; nothing was written")
    got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    diffs = [float(np.abs(g - e.numpy()).max()) if not non_finite(g) else math.nan
             for g, e in zip(got, expected, strict=True)]
    return worst_check(dict(enumerate(diffs)))[1]


def check_finite_outputs(plan: ExportPlan, checkpoint: Path) -> None:
    """Refuse a checkpoint whose finite weights give non-finite PyTorch outputs on the example inputs (overflow)."""
    with torch.no_grad():
        outputs = plan.module(*plan.inputs.values())
    for name, value in zip(plan.outputs, outputs, strict=True):
        if kind := non_finite(value):
            raise ExportError(f"{checkpoint}: PyTorch's {name} output holds {kind} on random inputs although its "
                              f"weights are finite (float32 overflow): {DIVERGED}; nothing was written")


def parity_checks(graph: onnx.ModelProto, path: Path, plan: ExportPlan, batch_5: dict[str, torch.Tensor],
                  real_inputs: list[dict[str, torch.Tensor]] | None = None,
                  external: bool = False) -> dict[str, float]:
    """Max abs difference between PyTorch (``plan.module``) and ``graph`` (saved to ``path``, its weights in
    ``path``.data when ``external``) under ONNX Runtime's CPU provider on random inputs at batch 2 and 5 and on the
    real inputs."""
    save_graph(graph, path, external)
    if external:  # an in-memory graph over 2 GiB cannot be checked as a message: the saved pair is
        onnx.checker.check_model(str(path))
    session = onnx_session(path, ["CPUExecutionProvider"])
    checks = {"random_batch_2": max_abs_diff(plan.module, session, plan.inputs, "random inputs"),
              "random_batch_5": max_abs_diff(plan.module, session, batch_5, "random inputs")}
    for i, inputs in enumerate(real_inputs or []):
        feed = {k: v for k, v in inputs.items() if not k.startswith("_")}  # "_labels" ride along
        if list(feed) != list(plan.inputs):
            raise ExportError(f"real inputs {list(feed)} do not match the model's inputs {list(plan.inputs)}")
        checks[f"real_{i}"] = max_abs_diff(plan.module, session, feed, f"real inputs {i}")
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
                                                           f"{' '.join(str(exc).split())})"}
    if not fusion["fused"]:
        return graph, None, {"optimized": False, "reason": "ONNX Runtime's optimizer fused nothing"}
    checks = parity(optimized)
    name, worst = worst_check(checks)
    if not worst <= tolerance:  # NaN: never within a tolerance
        why = f"by {worst:.2e}" if math.isfinite(worst) else "(its outputs are non-finite where PyTorch's are not)"
        return graph, None, {"optimized": False, "reason": f"the optimized graph disagrees with PyTorch {why} on "
                                                           f"{name}"}
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
                      img_size: int | None = None, optimize: bool = True, crop_pct: float | None = None,
                      external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> dict[str, Any]:
    """Export ``checkpoint`` to ``out`` (``NAME.onnx``) + its sidecar ``NAME.json`` (:func:`sidecar_of`; ``out`` is
    checked first, :func:`check_out`), removing the int8 copy of the export it replaces; returns the sidecar dict.
    ``img_size``: export for another image side than the checkpoint's (same patch size; the PE is resampled,
    ``Backbone.set_image_size``), e.g. a model fine-tuned at 32 px served at 48 px.
    ``optimize``: write ONNX Runtime's fused graph (:mod:`.optimize`; com.microsoft Attention / BiasGelu, so it
    needs ONNX Runtime) when it passes the parity check, else the plain graph — the sidecar's ``graph`` says which
    and why; ``False``: the plain standard-ONNX graph of the training model's own attention.

    Raises :class:`ExportError` (and writes nothing) when the weights or PyTorch's outputs are non-finite or the
    parity check fails (NaN never passes it)."""
    checkpoint, out = Path(checkpoint), check_out(out)
    if not tolerance >= 0:  # NaN too: a NaN tolerance would pass every difference
        raise ExportError(f"tolerance must be a number >= 0, got {tolerance}")
    try:
        backbone, metadata = load_pretrained(checkpoint)
        if img_size is not None:
            backbone.set_image_size(img_size)
            metadata = {**metadata, "img_size": img_size}
        if crop_pct is not None:  # the evaluation transform's crop_pct, where the checkpoint records none
            if not 0 < crop_pct <= 1:
                raise ExportError(f"crop_pct must be in (0, 1] (ImageNet: 0.875), got {crop_pct}")
            metadata = {**metadata, "crop_pct": crop_pct}
    except ModelError as exc:
        raise ExportError(str(exc)) from exc
    check_finite_weights(backbone, checkpoint)
    plan = plan_export(backbone.eval(), kind, speech_input, frontend=metadata.get("frontend"))
    check_finite_outputs(plan, checkpoint)
    batch = torch.export.Dim("batch", min=1, max=4096)
    dynamic = {name: {0: batch} for name in plan.inputs}
    # over protobuf's 2 GiB (e.g. ViT-H: 632M parameters, 2.5 GB): the weights go to NAME.onnx.data beside it
    external = weight_bytes(plan.module) > external_data_threshold
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=temporary_prefix(out)) as tmp:
        tmp_model = Path(tmp) / out.name
        # dynamo=True: the maintained exporter (the TorchScript one is deprecated since torch 2.9).
        torch.onnx.export(fusable(plan.module) if optimize else plan.module, tuple(plan.inputs.values()),
                          str(tmp_model), dynamo=True, opset_version=opset, input_names=list(plan.inputs),
                          output_names=plan.outputs, dynamic_shapes=tuple(dynamic.values()), external_data=external,
                          verbose=False)
        graph = onnx.load(str(tmp_model))  # with its external data, if any (read into memory)
        onnx.checker.check_model(str(tmp_model), full_check=True)  # by path: works over 2 GiB too
        batch_5 = plan_export(backbone, kind, speech_input, batch=5, frontend=metadata.get("frontend")).inputs
        parity = partial(parity_checks, path=tmp_model, plan=plan, batch_5=batch_5, real_inputs=real_inputs,
                         external=external)
        checks, info = None, {"optimized": False, "reason": "not asked (optimize=False)"}
        if optimize:
            graph, checks, info = optimized_or_not(graph, backbone, tolerance, parity)
        checks = checks or parity(graph)
        name, worst = worst_check(checks)
        if math.isnan(worst):
            raise ExportError(f"ONNX Runtime's outputs are non-finite (nan) on {name} where PyTorch's are finite: "
                              f"try --no-optimize or another --opset; nothing was written")
        if not worst <= tolerance:
            raise ExportError(f"ONNX Runtime disagrees with PyTorch by {worst:.2e} (> {tolerance:.0e}) on {name}: "
                              f"try --no-optimize or another --opset; nothing was written")
        sidecar = {
            "format": "patchplace.export/1", "kind": kind, "modality": backbone.config.modality,
            "export_id": uuid.uuid4().hex,
            "inputs": plan.input_specs, "outputs": plan.outputs, "opset": opset, "graph": info,
            "classes": metadata.get("classes"), "normalization": metadata.get("normalization"),
            "pad_to": metadata.get("pad_to"), "backbone": backbone.config.to_dict(),
            "parity": {"max_abs_diff": checks, "tolerance": tolerance},
            "external_data": {"file": data_of(out).name, "threshold_bytes": external_data_threshold} if external
            else None,
            "provenance": {"checkpoint": str(checkpoint.resolve()), "method": metadata.get("method"),
                           "checkpoint_sha256": sha256_file(checkpoint / "model.safetensors"),
                           "data": metadata.get("data")},
        }
        if backbone.config.modality == "image":
            sidecar["preprocessing"] = image_preprocessing(backbone, metadata)
        write_pair(graph, sidecar, Path(tmp), out)
    return sidecar


def temporary_prefix(out: Path) -> str:
    """``.NAME.HOST.PID.``: the prefix of an export's temporary directory beside ``out``, naming its owner."""
    return f".{out.name}.{re.sub(r'[^A-Za-z0-9-]', '-', socket.gethostname())}.{os.getpid()}."


def _alive(pid: int) -> bool:
    if os.name != "posix":  # os.kill(pid, 0) would end the process on Windows: count it alive (removed by age)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


STALE_AFTER_S = 24 * 3600  # a temporary directory whose owner cannot be checked is removed after this


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary directories that killed exports to ``out`` left beside it: those of a dead process on
    this host, and those whose owner cannot be checked (another host's, or named before owners were) once older than
    a day; a running export's stays. -> the directories removed."""
    own = temporary_prefix(out)
    here = own[: own.rstrip(".").rindex(".") + 1]  # .NAME.HOST.
    removed = []
    for entry in out.parent.iterdir():
        if not entry.name.startswith(f".{out.name}.") or entry.is_symlink() or not entry.is_dir():
            continue
        pid = entry.name[len(here):].split(".")[0] if entry.name.startswith(here) else ""
        try:
            stale = not _alive(int(pid)) if pid.isdigit() else time.time() - entry.stat().st_mtime > STALE_AFTER_S
        except FileNotFoundError:  # its export just finished
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to the disk: a renamed file survives a power cut whole."""
    if path.is_dir() and os.name != "posix":  # directories cannot be opened on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _record_data(tmp_model: Path, external: dict[str, Any] | None) -> None:
    """Put the external data file's sha256 and size into the sidecar's ``external_data`` record and flush it."""
    if external:
        external.update(sha256=sha256_file(data_of(tmp_model)), bytes=data_of(tmp_model).stat().st_size)
        _fsync(data_of(tmp_model))


def _commit_data(tmp_model: Path, out: Path, external: bool) -> None:
    """Move the new external data file into place, or remove the old export's: before the graph, so the old graph
    beside the new data has no sidecar (refused by :func:`load_export`)."""
    if external:
        os.replace(data_of(tmp_model), data_of(out))
    else:
        data_of(out).unlink(missing_ok=True)


def write_pair(graph: onnx.ModelProto, sidecar: dict[str, Any], tmp: Path, out: Path) -> None:
    """The commit: write ``graph`` (self-describing, with the export id) and its sidecar (with the graph file's
    sha256) into ``tmp``, then move them to ``out`` and its .json (:func:`sidecar_of`). The old sidecar goes first,
    then the old export's int8 copy (:func:`int8_of`: ``--quantize`` writes the new one after the commit), and the
    new sidecar comes last, so a kill at any instant leaves the old pair, a model.onnx without a sidecar, or the new
    pair — never an int8 copy of another checkpoint beside it — and a mismatched pair is refused by
    :func:`load_export` anyway."""
    tmp_model, tmp_json = tmp / out.name, tmp / "model.json"
    props = {**model_properties(sidecar, sidecar.get("preprocessing")), "export_id": sidecar["export_id"]}
    onnx.helper.set_model_props(graph, props)
    external = sidecar.get("external_data")  # NAME.onnx.data: the weights of a graph over 2 GiB
    save_graph(graph, tmp_model, bool(external))  # the same graph, now self-describing
    sidecar["onnx_sha256"] = sha256_file(tmp_model)
    _record_data(tmp_model, external)
    tmp_json.write_text(json.dumps(sidecar, indent=2) + "\n")
    _fsync(tmp_model)
    _fsync(tmp_json)
    sidecar_of(out).unlink(missing_ok=True)
    for copy in (int8_of(out), fp16_of(out)):  # the copies of the export replaced (--quantize / --fp16 follow)
        copy.unlink(missing_ok=True)
        data_of(copy).unlink(missing_ok=True)
    _commit_data(tmp_model, out, bool(external))
    os.replace(tmp_model, out)
    os.replace(tmp_json, sidecar_of(out))
    _fsync(out.parent)


def quantize_int8(path: str | os.PathLike) -> Path:
    """int8 dynamic quantization (onnxruntime.quantization, int8 weights per output channel) of the exported
    ``path`` into its int8 copy (:func:`int8_of`: ``NAME.int8.onnx``), its metadata_props kept; -> that path."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = Path(path)
    out = int8_of(path)
    model = onnx.load(str(path))
    del model.graph.value_info[:]  # the dynamo exporter's value_info trips ORT's shape re-inference; drop it
    remove_stale_temporaries(out)
    external = data_of(path).is_file()  # an fp32 graph over 2 GiB: its int8 copy may still fit in one file
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=temporary_prefix(out)) as tmp:  # all or nothing
        source, tmp_out = Path(tmp) / "model.onnx", Path(tmp) / out.name
        save_graph(model, source, external)
        # DefaultTensorType: shape inference gives no type past the com.microsoft ops of an optimized graph
        quantize_dynamic(source, f"{tmp}/int8.onnx", weight_type=QuantType.QInt8, per_channel=True,
                         use_external_data_format=external,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        del model.graph.initializer[:]  # the fp32 weights are no longer needed in memory
        quantized = onnx.load(f"{tmp}/int8.onnx")
        onnx.helper.set_model_props(quantized, {**{p.key: p.value for p in model.metadata_props},
                                                "quantization": "int8 dynamic (per-channel int8 weights)"})
        replace_graph(quantized, tmp_out, out)
    return out


def replace_graph(graph: onnx.ModelProto, tmp_out: Path, out: Path) -> None:
    """``graph`` written to ``tmp_out`` (its weights beside it as ``.data`` when over protobuf's limit), synced, then
    moved over ``out`` (and its data file): a reader sees the old file or the new one whole."""
    external = weight_bytes(graph) > EXTERNAL_DATA_THRESHOLD
    save_graph(graph, tmp_out, external)
    _fsync(tmp_out)
    data_of(out).unlink(missing_ok=True)
    if external:
        _fsync(data_of(tmp_out))
        os.replace(data_of(tmp_out), data_of(out))
    os.replace(tmp_out, out)


FP16_CONVERTER = "onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True)"


def convert_fp16(path: str | os.PathLike) -> Path:
    """The fp16 copy of the exported ``path`` (:func:`fp16_of`: ``NAME.fp16.onnx``) by ONNX Runtime's own converter
    (``onnxruntime.transformers.float16``: weights and activations fp16, inputs and outputs kept float32, ops
    without fp16 kernels left in float32), its metadata_props kept; written whole or not at all. -> that path."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    path = Path(path)
    out = fp16_of(path)
    model = onnx.load(str(path))
    remove_stale_temporaries(out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=temporary_prefix(out)) as tmp:  # all or nothing
        half = convert_float_to_float16(model, keep_io_types=True)
        onnx.helper.set_model_props(half, {**{p.key: p.value for p in model.metadata_props},
                                           "precision": f"fp16 ({FP16_CONVERTER})"})
        replace_graph(half, Path(tmp) / out.name, out)
    return out
