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
from typing import TYPE_CHECKING, Any

from patchplace.data.helpformat import help_formatter

from .choices import DEFAULT_OPSET, KINDS, SPEECH_INPUTS
from .cli import OneLineParser

if TYPE_CHECKING:  # torch, the models and the exporter are imported once the arguments parse: --help needs none
    import torch


def check_checkpoint(checkpoint: str) -> None:
    """Refuse, before any work, a CHECKPOINT that is no checkpoint directory (one line, exit 2)."""
    from .exporter import ExportError

    path = Path(checkpoint)
    if not path.is_dir():
        raise ExportError(f"{checkpoint}: {'no such directory' if not path.exists() else 'a file, not a directory'}; "
                          "give a save_pretrained() checkpoint directory (config.json + model.safetensors), e.g. "
                          "runs/NAME/checkpoint")


def real_inputs(checkpoint: str, split: str, samples: int, kind: str, speech_input: str,
                img_size: int | None = None, crop_pct: float | None = None) -> list[dict[str, torch.Tensor]]:
    """The first ``samples`` inputs of ``split``, preprocessed as for evaluation, as ONNX feeds (+ labels)."""
    import torch

    from patchplace.data import Manifest, ShardDataset, build_transform
    from patchplace.data.mfcc import build_frontend
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
        feed = {"waveform": x} if speech_input == "waveform" else \
            {"features": build_frontend(metadata.get("frontend"))(x)}  # the front end the checkpoint trained on
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


FP16_TOLERANCE = 1e-2  # max abs difference from the fp32 graph, per output, as a fraction of max(1, its max |value|)
FP16_AGREEMENT = 0.99  # top-1 agreement with the fp32 graph on the real samples (--data)


def fp16_feeds(sidecar: dict, real: list[dict[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """The inputs of the fp16 parity gate: random ones at batch 2 and 5 (as the fp32 gate's) and the real samples."""
    import torch

    torch.manual_seed(0)
    feeds = {}
    for batch in (2, 5):
        feed = {}
        for spec in sidecar["inputs"]:
            shape = [batch, *spec["shape"][1:]]
            feed[spec["name"]] = ((torch.rand(*shape) < 0.15) if spec["dtype"] == "bool" else torch.randn(*shape)
                                  * {"waveform": 0.1, "features": 10.0}.get(spec["name"], 1.0)).numpy()
        feeds[f"random_batch_{batch}"] = feed
    for i, inputs in enumerate(real):
        feeds[f"real_{i}"] = {k: v.numpy() for k, v in inputs.items() if not k.startswith("_")}
    return feeds


def half(path: str, sidecar: dict, real: list[dict[str, torch.Tensor]], split: str | None,
         tolerance: float = FP16_TOLERANCE, agreement: float = FP16_AGREEMENT) -> dict:
    """The fp16 copy (ONNX Runtime's converter, :func:`~.exporter.convert_fp16`) and its parity gate against the
    fp32 graph on the CPU: every output within ``tolerance`` x max(1, max |fp32 output|) on random and real inputs,
    and (classifiers) a top-1 agreement of at least ``agreement`` on the real samples; a copy that misses either,
    or whose outputs are non-finite, is removed and the export fails (the fp32 pair stays: it passed its own)."""
    import numpy as np

    from .exporter import ExportError, convert_fp16, fp16_of, non_finite, onnx_session

    out = convert_fp16(path)
    try:
        fp32, fp16 = (onnx_session(p, ["CPUExecutionProvider"]) for p in (path, out))
        names = [o.name for o in fp32.get_outputs()]
        checks, agree, count = {}, 0, 0
        for label, feed in fp16_feeds(sidecar, real).items():
            want, got = fp32.run(None, feed), fp16.run(None, feed)
            for name, w, g in zip(names, want, got, strict=True):
                if kind := non_finite(g):
                    raise ExportError(f"the fp16 model's {name} hold {kind} on {label} where the fp32 model's are "
                                      "finite (fp16 overflow)")
                checks[f"{label}/{name}"] = {"max_abs_diff": float(np.abs(g - w).max()),
                                             "scale": max(1.0, float(np.abs(w).max()))}
            if "logits" in names and label.startswith("real"):
                i = names.index("logits")
                agree += int((want[i].argmax(1) == got[i].argmax(1)).sum())
                count += len(want[i])
        worst = max(checks, key=lambda k: checks[k]["max_abs_diff"] / checks[k]["scale"])
        ratio = checks[worst]["max_abs_diff"] / checks[worst]["scale"]
        if not ratio <= tolerance:
            raise ExportError(f"the fp16 model differs from the fp32 one by {checks[worst]['max_abs_diff']:.2e} on "
                              f"{worst} (> {tolerance:.0e} x {checks[worst]['scale']:.3g})")
        top1 = agree / count if count else None
        if top1 is not None and top1 < agreement:
            raise ExportError(f"the fp16 model's top-1 agrees with the fp32 one's on {top1:.2%} of the samples of "
                              f"{split} (< {agreement:.0%})")
    except ExportError as exc:
        out.unlink(missing_ok=True)
        raise ExportError(f"{exc}: {fp16_of(path).name} was removed; use the fp32 model {path} (it passed its "
                          "parity check)") from None
    sizes = [Path(p).stat().st_size for p in (out, path)]
    return {"path": str(out), "bytes": sizes[0], "fp32_bytes": sizes[1], "converter": "onnxruntime.transformers."
            "float16.convert_float_to_float16(keep_io_types=True)", "tolerance": tolerance,
            "max_abs_diff": checks[worst]["max_abs_diff"], "worst": worst, "relative_to": checks[worst]["scale"],
            "checks": checks, "top1_agreement": top1, "agreement_required": agreement, "samples": count,
            "split": split}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m patchplace.export", description=__doc__,
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
    parser.add_argument("--fp16", action="store_true", help="also write an fp16 copy NAME.fp16.onnx (ONNX "
                        "Runtime's float16 converter, float32 inputs / outputs), kept only when it passes its parity "
                        f"gate against the fp32 graph: every output within {FP16_TOLERANCE:g} x max(1, max |output|), "
                        f"top-1 agreement >= {FP16_AGREEMENT * 100:g}%% on the --data samples")
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
    from patchplace.models import ModelError

    from .exporter import ExportError, check_out, describe_graph, export_checkpoint

    try:
        check_out(args.out)  # before any work: a place the export cannot write is one line, nothing done
        check_checkpoint(args.checkpoint)
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
        if args.fp16:
            report["fp16"] = half(args.out, sidecar, real, args.data)
    except (ExportError, DataError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
