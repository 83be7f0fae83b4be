"""The int8 and fp16 copies of an export (``NAME.int8.onnx``, ``NAME.fp16.onnx``), each by ONNX Runtime's own tool,
its metadata_props kept, written whole or not at all (their parity gates: :mod:`patchplace.export.__main__`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx

from patchplace.data.atomic import fsync

from .files import (
    EXTERNAL_DATA_THRESHOLD,
    data_of,
    fp16_of,
    int8_of,
    remove_stale_temporaries,
    save_graph,
    temporary_prefix,
    weight_bytes,
)


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
    fsync(tmp_out)
    data_of(out).unlink(missing_ok=True)
    if external:
        fsync(data_of(tmp_out))
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
