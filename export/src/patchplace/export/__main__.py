"""``python -m patchplace.export CHECKPOINT --out model.onnx``: export + PyTorch / ONNX Runtime parity check."""

from __future__ import annotations

import argparse
import json
import sys

from .exporter import DEFAULT_OPSET, KINDS, SPEECH_INPUTS, ExportError, export_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patchplace.export", description=__doc__)
    parser.add_argument("checkpoint", help="a save_pretrained() directory (config.json + model.safetensors)")
    parser.add_argument("--out", required=True, help="output .onnx path; the sidecar goes next to it as .json")
    parser.add_argument("--kind", choices=KINDS, default="classifier", help="default: %(default)s")
    parser.add_argument("--speech-input", choices=SPEECH_INPUTS, default="waveform",
                        help="speech models: MFCC inside the graph (waveform) or not (features)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset (>= 17; default %(default)s)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max abs diff allowed (default %(default)s)")
    args = parser.parse_args(argv)
    if args.opset < 17:
        parser.error("--opset must be >= 17")
    try:
        sidecar = export_checkpoint(args.checkpoint, args.out, kind=args.kind, speech_input=args.speech_input,
                                    opset=args.opset, tolerance=args.tolerance)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"onnx": args.out, "parity": sidecar["parity"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
