"""``python -m patchplace.export CHECKPOINT --out model.onnx``: export + PyTorch / ONNX Runtime parity check.

``--data SPLIT`` adds real inputs (the first images / clips of a shard split, preprocessed as for evaluation) to
the parity check; ``--quantize`` also writes an int8 dynamically quantized copy (``model.int8.onnx``) and, with
``--data``, reports its top-1 change on those samples. ``--out NAME.onnx`` names the rest: the sidecar ``NAME.json``
and the int8 copy ``NAME.int8.onnx`` (a re-export without ``--quantize`` removes the old one)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from patchplace.data.helpformat import help_formatter

from .choices import DEFAULT_OPSET, KINDS, SPEECH_INPUTS

if TYPE_CHECKING:  # torch, the models and the exporter are imported once the arguments parse: --help needs none
    import torch


def real_inputs(checkpoint: str, split: str, samples: int, kind: str, speech_input: str,
                img_size: int | None = None, crop_pct: float | None = None) -> list[dict[str, torch.Tensor]]:
    """The first ``samples`` inputs of ``split``, preprocessed as for evaluation, as ONNX feeds (+ labels)."""
    import torch

    from patchplace.data import Manifest, ShardDataset, build_transform
    from patchplace.data.mfcc import MFCC
    from patchplace.models import read_config

    from .exporter import recorded_crop_pct

    config, metadata = read_config(checkpoint)
    if img_size is not None:
        config = replace(config, img_size=img_size)
    manifest = Manifest.load(split)
    side = img_size or metadata.get("img_size")
    options = {"pad_to": metadata.get("pad_to"), "img_size": side} if manifest.modality == "image" else {}
    if options and not options["pad_to"]:  # the evaluation transform the export records (model.json)
        options["crop_pct"] = crop_pct if crop_pct is not None else recorded_crop_pct(metadata)[0]
    dataset = ShardDataset(manifest, transform=build_transform(manifest, train=False, **options),
                           epoch_length=min(samples, manifest.num_samples))
    x, y = (torch.stack(t) if i == 0 else torch.tensor(t) for i, t in enumerate(zip(*dataset, strict=True)))
    if manifest.modality == "audio":
        feed = {"waveform": x} if speech_input == "waveform" else {"features": MFCC()(x)}
    else:
        feed = {"pixels": x}
        if config.unknown_pos and kind == "classifier":
            feed["unknown_pos"] = torch.zeros(len(x), config.num_patches, dtype=torch.bool)
    return [{**feed, "_labels": y}]


def quantize(path: str, real: list[dict[str, torch.Tensor]], split: str | None) -> dict:
    """int8 dynamic quantization of the exported graph and its top-1 change on the real samples (an int8 model
    whose logits are non-finite there is removed, and the export fails)."""
    from .exporter import ExportError, data_of, non_finite, onnx_session, quantize_int8

    out = quantize_int8(path)
    sizes = [sum(f.stat().st_size for f in (p, data_of(p)) if f.is_file()) for p in (out, Path(path))]
    result = {"path": str(out), "bytes": sizes[0], "fp32_bytes": sizes[1]}  # external data files counted
    if real:
        feed = {k: v.numpy() for k, v in real[0].items() if not k.startswith("_")}
        labels = real[0]["_labels"].numpy()
        fp32 = onnx_session(path).run(None, feed)[0].argmax(1)
        int8_logits = onnx_session(out).run(None, feed)[0]
        if kind := non_finite(int8_logits):
            out.unlink()
            raise ExportError(f"the int8 model's logits hold {kind} on the samples of {split}: it was removed, no "
                              f"top-1 reported; use the fp32 model {path} (it passed the parity check)")
        int8 = int8_logits.argmax(1)
        fp32_top1, int8_top1 = float((fp32 == labels).mean()), float((int8 == labels).mean())
        result.update(samples=len(labels), split=split, fp32_top1=fp32_top1, int8_top1=int8_top1,
                      top1_delta=round(int8_top1 - fp32_top1, 6), agreement=float((fp32 == int8).mean()))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patchplace.export", description=__doc__,
                                     formatter_class=help_formatter(argparse.HelpFormatter))
    parser.add_argument("checkpoint", help="a save_pretrained() directory (config.json + model.safetensors)")
    parser.add_argument("--out", required=True, help="output NAME.onnx; the sidecar NAME.json goes beside it")
    parser.add_argument("--kind", choices=KINDS, default="classifier", help="default: %(default)s")
    parser.add_argument("--speech-input", choices=SPEECH_INPUTS, default="waveform",
                        help="speech models: MFCC inside the graph (waveform) or not (features)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset (>= 17; default %(default)s)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max abs diff allowed (default %(default)s)")
    parser.add_argument("--data", help="shard split whose first samples join the parity check (e.g. the test split)")
    parser.add_argument("--samples", type=int, default=256, help="real samples for parity / int8 check")
    parser.add_argument("--quantize", action="store_true", help="also write an int8 dynamic-quantized model")
    parser.add_argument("--no-optimize", action="store_true", help="write the plain standard-ONNX graph instead of "
                        "ONNX Runtime's fused one (com.microsoft Attention / BiasGelu ops)")
    parser.add_argument("--img-size", type=int, help="export for this image side instead of the checkpoint's "
                        "(same patch size; the PE is resampled)")
    parser.add_argument("--crop-pct", type=float, help="the evaluation transform's crop_pct (resize the short side to "
                        "floor(size / crop_pct), centre crop; ImageNet: 0.875), where the checkpoint records none "
                        "(default: its metadata's, else 1.0); recorded in model.json for the evaluator")
    args = parser.parse_args(argv)
    if args.opset < 17:
        parser.error("--opset must be >= 17")
    from patchplace.data import DataError

    from .exporter import ExportError, check_out, describe_graph, export_checkpoint

    try:
        check_out(args.out)  # before any work: a place the export cannot write is one line, nothing done
        real = real_inputs(args.checkpoint, args.data, args.samples, args.kind, args.speech_input,
                           args.img_size, args.crop_pct) if args.data else []
        sidecar = export_checkpoint(args.checkpoint, args.out, kind=args.kind, speech_input=args.speech_input,
                                    opset=args.opset, tolerance=args.tolerance, real_inputs=real,
                                    img_size=args.img_size, optimize=not args.no_optimize,
                                    crop_pct=args.crop_pct)
        print(describe_graph(sidecar["graph"]), file=sys.stderr)
        report = {"onnx": args.out, "graph": sidecar["graph"], "parity": sidecar["parity"]}
        if args.quantize:
            report["int8"] = quantize(args.out, real, args.data)
    except (ExportError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
