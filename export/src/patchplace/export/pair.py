"""The bound pair: ``NAME.onnx`` and its sidecar ``NAME.json`` carry one ``export_id`` and the sidecar records the
graph file's sha256, so :func:`load_export` refuses a model.onnx beside another export's model.json (or changed
since, or whose sidecar was edited). The commit (:func:`write_pair`) removes the old sidecar first and renames the
new one into place last."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import onnx

from patchplace.data.atomic import fsync
from patchplace.data.manifest import sha256_file

from .errors import ExportError
from .files import INT8_SUFFIX, copy_suffix, data_of, fp16_of, fp32_of, int8_of, save_graph, sidecar_of
from .runtime import onnx_session, ort


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


def _record_data(tmp_model: Path, external: dict[str, Any] | None) -> None:
    """Put the external data file's sha256 and size into the sidecar's ``external_data`` record and flush it."""
    if external:
        external.update(sha256=sha256_file(data_of(tmp_model)), bytes=data_of(tmp_model).stat().st_size)
        fsync(data_of(tmp_model))


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
    fsync(tmp_model)
    fsync(tmp_json)
    sidecar_of(out).unlink(missing_ok=True)
    for copy in (int8_of(out), fp16_of(out)):  # the copies of the export replaced (--quantize / --fp16 follow)
        copy.unlink(missing_ok=True)
        data_of(copy).unlink(missing_ok=True)
    _commit_data(tmp_model, out, bool(external))
    os.replace(tmp_model, out)
    os.replace(tmp_json, sidecar_of(out))
    fsync(out.parent)
