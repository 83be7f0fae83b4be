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

This module traces and gates; the parts it uses live beside it, and every name is importable from here too:
:mod:`.plan` (what is traced), :mod:`.transform_record` (the recorded preprocessing), :mod:`.files` (names, saving,
``--out`` checks), :mod:`.pair` (the commit and the loader's checks), :mod:`.variants` (the int8 / fp16 copies),
:mod:`.runtime` (ONNX Runtime and its session), :mod:`.errors`.
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxscript  # noqa: F401 - torch.onnx.export(dynamo=True) builds the graph with it: a runtime requirement
import torch
from torch import nn

from patchplace.data.manifest import sha256_file
from patchplace.models import Backbone, ModelError, load_pretrained

from .choices import DEFAULT_OPSET, KINDS, SPEECH_INPUTS
from .errors import DIVERGED, ExportError, Unavailable, non_finite, worst_check
from .files import (
    EXTERNAL_DATA_THRESHOLD,
    FP16_SUFFIX,
    INT8_SUFFIX,
    PROTOBUF_LIMIT,
    STALE_AFTER_S,
    check_out,
    check_writable,
    copy_suffix,
    data_of,
    fp16_of,
    fp32_of,
    int8_of,
    remove_stale_temporaries,
    save_graph,
    sidecar_of,
    temporary_prefix,
    weight_bytes,
)
from .optimize import fusable, optimize_graph
from .pair import (
    OUTPUT_MEANING,
    SIDECAR_PROPS,
    consistency_problem,
    first_difference,
    load_export,
    model_properties,
    sidecar_problem,
    write_pair,
)
from .plan import Classifier, ExportPlan, FeatureExtractor, SpeechModel, clip_samples, plan_export
from .runtime import onnx_session, ort
from .transform_record import eval_transform, image_preprocessing, recorded_crop_pct, recorded_interpolation
from .variants import FP16_CONVERTER, convert_fp16, quantize_int8, replace_graph

# the names this module has always offered (the CLI, the evaluator, the benchmarks and the tests import them here)
__all__ = [
    "DEFAULT_OPSET", "DIVERGED", "EXTERNAL_DATA_THRESHOLD", "FP16_CONVERTER", "FP16_SUFFIX", "INT8_SUFFIX", "KINDS",
    "OUTPUT_MEANING", "PROTOBUF_LIMIT", "SIDECAR_PROPS", "SPEECH_INPUTS", "STALE_AFTER_S", "Classifier",
    "ExportError", "ExportPlan", "FeatureExtractor", "SpeechModel", "Unavailable", "check_finite_outputs",
    "check_finite_weights", "check_out", "check_writable", "clip_samples", "consistency_problem", "convert_fp16",
    "copy_suffix", "data_of", "describe_graph", "eval_transform", "export_checkpoint", "first_difference",
    "fp16_of", "fp32_of", "image_preprocessing", "int8_of", "load_export", "max_abs_diff", "model_properties",
    "non_finite", "onnx_session", "optimized_or_not", "ort", "parity_checks", "plan_export", "quantize_int8",
    "recorded_crop_pct", "recorded_interpolation", "remove_stale_temporaries", "replace_graph", "save_graph",
    "sha256_file", "sidecar_of", "sidecar_problem", "temporary_prefix", "weight_bytes", "worst_check",
    "write_pair",
]


def check_finite_weights(backbone: Backbone, checkpoint: Path) -> None:
    """Refuse a checkpoint any of whose weights (parameters and buffers, after ``set_image_size``) is NaN or
    infinite (``load_pretrained`` may refuse it first, with the same advice)."""
    state = backbone.state_dict()
    bad = [name for name, tensor in state.items() if non_finite(tensor)]
    if bad:
        kinds = " and ".join(sorted({k for name in bad for k in non_finite(state[name]).split(" and ")}))
        raise ExportError(f"{checkpoint} holds non-finite weights ({kinds} in {len(bad)} tensor(s), e.g. {bad[0]}): "
                          f"{DIVERGED}; nothing was written")


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
    backbone, metadata = load_checkpoint(checkpoint, img_size, crop_pct)
    check_finite_weights(backbone, checkpoint)
    plan = plan_export(backbone.eval(), kind, speech_input, frontend=metadata.get("frontend"))
    check_finite_outputs(plan, checkpoint)
    # over protobuf's 2 GiB (e.g. ViT-H: 632M parameters, 2.5 GB): the weights go to NAME.onnx.data beside it
    external = weight_bytes(plan.module) > external_data_threshold
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=temporary_prefix(out)) as tmp:
        tmp_model = Path(tmp) / out.name
        trace(plan, tmp_model, opset, external, optimize)
        graph = onnx.load(str(tmp_model))  # with its external data, if any (read into memory)
        onnx.checker.check_model(str(tmp_model), full_check=True)  # by path: works over 2 GiB too
        batch_5 = plan_export(backbone, kind, speech_input, batch=5, frontend=metadata.get("frontend")).inputs
        parity = partial(parity_checks, path=tmp_model, plan=plan, batch_5=batch_5, real_inputs=real_inputs,
                         external=external)
        graph, checks, info = gated_graph(graph, backbone, tolerance, parity, optimize)
        sidecar = sidecar_record(checkpoint, backbone, metadata, plan, kind=kind, opset=opset, graph=info,
                                 checks=checks, tolerance=tolerance,
                                 external={"file": data_of(out).name, "threshold_bytes": external_data_threshold}
                                 if external else None)
        write_pair(graph, sidecar, Path(tmp), out)
    return sidecar


def load_checkpoint(checkpoint: Path, img_size: int | None, crop_pct: float | None
                    ) -> tuple[Backbone, dict[str, Any]]:
    """The checkpoint's backbone and metadata, at ``img_size`` (its PE resampled) and with the evaluation
    transform's ``crop_pct`` where given; a checkpoint the models package refuses is an :class:`ExportError`."""
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
    return backbone, metadata


def trace(plan: ExportPlan, path: Path, opset: int, external: bool, optimize: bool) -> None:
    """``torch.onnx.export`` of ``plan`` to ``path`` with a dynamic batch (``optimize``: the attention in the form
    ONNX Runtime's optimizer fuses, :func:`~.optimize.fusable`)."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    dynamic = {name: {0: batch} for name in plan.inputs}
    # dynamo=True: the maintained exporter (the TorchScript one is deprecated since torch 2.9).
    torch.onnx.export(fusable(plan.module) if optimize else plan.module, tuple(plan.inputs.values()),
                      str(path), dynamo=True, opset_version=opset, input_names=list(plan.inputs),
                      output_names=plan.outputs, dynamic_shapes=tuple(dynamic.values()), external_data=external,
                      verbose=False)


def gated_graph(graph: onnx.ModelProto, backbone: Backbone, tolerance: float,
                parity: Callable[[onnx.ModelProto], dict[str, float]], optimize: bool
                ) -> tuple[onnx.ModelProto, dict[str, float], dict[str, Any]]:
    """(the graph to write, its parity checks, the sidecar's ``graph`` record): ONNX Runtime's optimized graph when
    asked and within ``tolerance``, else the plain one — which must itself pass, or :class:`ExportError`."""
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
    return graph, checks, info


def sidecar_record(checkpoint: Path, backbone: Backbone, metadata: dict[str, Any], plan: ExportPlan, *, kind: str,
                   opset: int, graph: dict[str, Any], checks: dict[str, float], tolerance: float,
                   external: dict[str, Any] | None) -> dict[str, Any]:
    """The sidecar ``NAME.json`` of an export (a new ``export_id``; the commit adds the graph file's sha256)."""
    sidecar = {
        "format": "patchplace.export/1", "kind": kind, "modality": backbone.config.modality,
        "export_id": uuid.uuid4().hex,
        "inputs": plan.input_specs, "outputs": plan.outputs, "opset": opset, "graph": graph,
        "classes": metadata.get("classes"), "normalization": metadata.get("normalization"),
        "pad_to": metadata.get("pad_to"), "backbone": backbone.config.to_dict(),
        "parity": {"max_abs_diff": checks, "tolerance": tolerance},
        "external_data": external,
        "provenance": {"checkpoint": str(checkpoint.resolve()), "method": metadata.get("method"),
                       "checkpoint_sha256": sha256_file(checkpoint / "model.safetensors"),
                       "data": metadata.get("data")},
    }
    if backbone.config.modality == "image":
        sidecar["preprocessing"] = image_preprocessing(backbone, metadata)
    return sidecar
