"""The main job on the built-in data: MP3 pretraining on Fashion-MNIST -> fine-tuning -> evaluation -> ONNX export
(with the PyTorch / ONNX Runtime parity check) -> report.

    python pipelines/demo.py                       # ~13 min on a 2-core CPU (the defaults of `make demo`)
    python pipelines/demo.py --pretrain-epochs 20 --finetune-epochs 20 --patch-size 4 --out runs/demo_long

Defaults sized for a laptop CPU: the narrow ViT (128 wide, 6 deep) on 32 px Fashion-MNIST with 8 px patches
(16 positions: ~4x cheaper per image than patch 4, ~1,000 images/s on 2 cores) and the short-budget recipe of the
study (no Mixup / CutMix, crop scale [0.8, 1], no layer decay — at a few epochs they cost more than they regularize).

Resumable: every stage resumes from its last checkpoint and is skipped once done (``<stage>/DONE``). Writes
``<out>/report.md`` with the numbers and PNG plots (loss curves, MP3 position accuracy vs eta, reassembled images).
Extra ``section.field=value`` arguments go to every stage (e.g. ``data.num_workers=0``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchplace.pipelines import CONFIGS
from patchplace.pipelines.help import HelpFormatter
from patchplace.pipelines.stages import StageError, by_precision
from patchplace.pipelines.stages import stage as run_stage

if TYPE_CHECKING:  # the engine and the evaluator load torch: imported when the demo runs, not for --help
    from patchplace.pipelines.engine.hardware import Precision

# MP3 2 + fine-tune 3 epochs: calibrated so that fine-tuned top-1 clears 0.85 (2 + 2 measured 0.856) in ~20 min
PRETRAIN_EPOCHS, FINETUNE_EPOCHS = 2.0, 3.0
# The study's short-budget fine-tuning recipe (pipelines/configs/study_fashion_mnist.yaml explains it).
SHORT_RECIPE = ["finetune.mixup=0.0", "finetune.cutmix=0.0", "optim.layer_decay=null"]


# what to pip install for a module the export / ONNX Runtime stages import (ONNX Runtime is an extra of
# patchplace-export, and a wheel of that is not on PyPI: name the runtime itself)
INSTALL = {"onnxruntime": "onnxruntime (or onnxruntime-gpu on a CUDA machine, not both)",
           "patchplace": "./export (from a checkout of patchplace)"}


def ort_stages() -> tuple[Callable[[list[str]], Any], Callable[[list[str]], Any]]:
    """(export main, ONNX Runtime evaluation main), imported when the demo runs, not for --help; a missing module
    is one line naming what to pip install, said before any stage trains."""
    try:
        from patchplace.export.__main__ import main as export_main
        from patchplace.export.evaluate import main as ort_evaluate_main
    except ImportError as exc:
        name = exc.name or getattr(exc.__cause__, "name", None) or "onnxruntime"
        top = name.split(".")[0]
        raise SystemExit(f"error: the demo's ONNX export and ONNX Runtime stages need {name}, which is not "
                         f"installed: pip install {INSTALL.get(top, top)}") from None
    return export_main, ort_evaluate_main


def stage(out: Path, name: str, run, argv: list[str]) -> float:
    """One demo stage (``<out>/<name>/DONE`` when finished; see ``patchplace.pipelines.stages.stage``)."""
    try:
        return run_stage(out / name, run, argv, label=f"demo {name}")
    except StageError as exc:
        raise SystemExit(f"[demo] {exc}") from None


def loss_plot(logs: dict[str, Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(logs), figsize=(4.2 * len(logs), 3))
    for ax, (title, log) in zip(axes, logs.items(), strict=True):
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        rows = [r for r in rows if "loss" in r]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
        ax.set(title=title, xlabel="step", ylabel="loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ort_summary(ort: dict) -> str:
    """One paragraph of the ONNX Runtime evaluation (accuracy, consistency, robustness, latency)."""
    a, c = ort["accuracy"], ort["consistency"].get("0.15", {})
    text = (f"ONNX Runtime ({', '.join(ort['providers'])}): test top-1 {a['top1']:.4f} on {a['count']} images; "
            f"consistency {c.get('consistency', float('nan')):.3f} / Diff. Norm {c.get('diff_norm', float('nan')):.3f} "
            "at gamma 0.15")
    if "robustness" in ort:
        r = ort["robustness"]
        text += (f"; mean corruption error {r['mean_error']:.3f} over {len(r['ran'])} corruptions x 5 severities "
                 f"(failed here: {', '.join(r['failed']) or 'none'})")
    lat = ort.get("latency", {})
    if "onnxruntime/batch64" in lat and "pytorch/batch64" in lat:
        text += (f"; batch-64 latency p50 {lat['onnxruntime/batch64']['p50_ms']:.0f} ms (ONNX Runtime) vs "
                 f"{lat['pytorch/batch64']['p50_ms']:.0f} ms (PyTorch eager)")
    return text + ". Details: `evaluate_onnx/results.md`."


def versus_supervised(out: Path, seconds: dict[str, float], pretrained_top1: float) -> list[str]:
    """What pretraining bought: the fine-tuned MP3 model beside the same ViT trained from scratch for the same total
    epochs with the same recipe (the ``supervised`` stage), on the same test images."""
    log = out / "supervised" / "log.jsonl"
    if "supervised" not in seconds or not log.is_file():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    top1 = [r["eval"] for r in rows if "eval" in r][-1]["top1"]
    delta = (pretrained_top1 - top1) * 100
    verdict = (f"MP3 pretraining bought {delta:+.1f} points of test top-1 at this budget" if delta > 0 else
               f"at this budget MP3 pretraining did not pay off ({delta:+.1f} points)")
    return ["| model (same ViT, same total epochs, same test images) | training wall-clock | test top-1 |",
            "| --- | --- | --- |",
            f"| MP3 pretraining + fine-tuning | {(seconds['pretrain'] + seconds['finetune']) / 60:.1f} min | "
            f"{pretrained_top1:.4f} |",
            f"| supervised from scratch | {seconds['supervised'] / 60:.1f} min | {top1:.4f} |", "",
            f"{verdict[0].upper() + verdict[1:]} (one seed: a difference of a point or so is within seed noise; "
            "`make study` measures three).", ""]


def report(out: Path, seconds: dict[str, float], precision: Precision) -> str:
    ft = json.loads((out / "evaluate_finetuned" / "results.json").read_text())
    pre = json.loads((out / "evaluate_pretrained" / "results.json").read_text())
    onnx_parity = json.loads((out / "export" / "model.json").read_text())["parity"]["max_abs_diff"]
    ort = json.loads((out / "evaluate_onnx" / "results.json").read_text())
    pretrain_log = [json.loads(line) for line in (out / "pretrain" / "log.jsonl").read_text().splitlines()]
    last = [r for r in pretrain_log if "pos_acc" in r][-1]
    lines = ["# patchplace demo: MP3 on Fashion-MNIST", "",
             "MP3 pretraining (no PE, context-only attention) -> fine-tuning with a learned PE -> evaluation.", "",
             f"Training precision: {'float32' if precision.value == 'no' else precision.value} ({precision.why}).",
             ""]
    lines += versus_supervised(out, seconds, ft["classification"]["top1"])
    lines += ["| stage | wall-clock | result |", "| --- | --- | --- |",
             f"| pretrain (MP3) | {seconds['pretrain'] / 60:.1f} min | train position accuracy {last['pos_acc']:.3f} "
             f"(top-5 {last['pos_acc_top5']:.3f}) at the last logged step |",
             f"| fine-tune | {seconds['finetune'] / 60:.1f} min | test top-1 {ft['classification']['top1']:.4f}, "
             f"top-5 {ft['classification']['top5']:.4f} |",
             f"| evaluate | {(seconds['evaluate_finetuned'] + seconds['evaluate_pretrained']) / 60:.1f} min | "
             f"linear probe of the pretrained backbone {pre['linear_probe']['top1']:.4f}, of the fine-tuned "
             f"{ft['linear_probe']['top1']:.4f} |", ""]
    if "mp3_position_accuracy" in pre:
        lines += ["MP3 test-set position accuracy vs evaluation masking ratio (Fig. 3):", "",
                  "| eta | top-1 | top-5 |", "| --- | --- | --- |"]
        curve = pre["mp3_position_accuracy"]
        lines += [f"| {e} | {curve[e]['top1']:.3f} | {curve[e]['top5']:.3f} |" for e in sorted(curve, key=float)]
        lines += [""]
    knn = ", ".join(f"L{k} {v:.3f}" for k, v in pre["knn_per_layer"].items())
    lines += [f"kNN top-1 per layer (pretrained): {knn}",
              "", "MJP consistency of the fine-tuned model (eval gamma: consistency / Diff. Norm): "
              + ", ".join(f"{g}: {v['consistency']:.3f} / {v['diff_norm']:.3f}" for g, v in ft["consistency"].items()),
              "", f"ONNX export of the fine-tuned model: `export/model.onnx`, max |ONNX Runtime - PyTorch| = "
             f"{max(onnx_parity.values()):.1e} (tolerance 1e-4)",
             "", ort_summary(ort),
             "", "![losses](losses.png)", "", "![MP3 position accuracy](mp3_position_accuracy.png)", "",
              "![reassembled](mp3_reassembled.png)", "",
              "Full results: `evaluate_pretrained/results.json`, `evaluate_finetuned/results.json`."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="run directory (default: %(default)s)")
    parser.add_argument("--pretrain-epochs", type=float, default=PRETRAIN_EPOCHS,
                        help="MP3 epochs (default: %(default)s)")
    parser.add_argument("--finetune-epochs", type=float, default=FINETUNE_EPOCHS,
                        help="fine-tuning epochs (default: %(default)s)")
    parser.add_argument("--preset", default="vit_cpu_narrow", help="backbone preset (default: %(default)s)")
    parser.add_argument("--patch-size", type=int, default=8, help="patch side in pixels (default: %(default)s)")
    parser.add_argument("--no-supervised", action="store_true",
                        help="skip the same-budget supervised ViT trained from scratch beside the pretrained one")
    parser.add_argument("--precision", choices=["auto", "no", "bf16"], default="auto",
                        help="training precision: auto (bf16 only where the device has bf16 units and bf16 "
                        "training passed its equivalence test, else float32; docs/benchmarks.md) | no | bf16 "
                        "(default: %(default)s)")
    parser.add_argument("--ort-robustness-limit", type=int, default=500,
                        help="test images for the ONNX Runtime corruption sweep (default: %(default)s)")
    parser.add_argument("--ort-latency-repeats", type=int, default=20, help="timed runs per batch size")
    parser.add_argument("overrides", nargs="*", help="section.field=value passed to every stage (eval.* to the "
                                                     "evaluations only)")
    return parser.parse_args(argv)


def train_stages(args: argparse.Namespace, extra: list[str]) -> dict[str, float]:
    """MP3 pretraining, its fine-tuning and (unless --no-supervised) the same ViT from scratch: seconds by stage.
    ``extra``: the overrides every training stage gets (the recipe's fine-tuning adds SHORT_RECIPE)."""
    out = args.out
    model = [f"model.preset={args.preset}", f"model.overrides={{patch_size: {args.patch_size}}}"]
    recipe = [*SHORT_RECIPE, *extra]
    train = {name: by_precision(f"patchplace.pipelines.{name}") for name in ("pretrain", "finetune")}
    seconds = {
        "pretrain": stage(out, "pretrain", train["pretrain"], [
            "--config", str(CONFIGS / "mp3_fashion_mnist.yaml"), f"run.output={out / 'pretrain'}", "run.resume=true",
            f"optim.epochs={args.pretrain_epochs}", *model, *extra]),
    }
    seconds["finetune"] = stage(out, "finetune", train["finetune"], [
        "--config", str(CONFIGS / "finetune_fashion_mnist.yaml"), f"run.output={out / 'finetune'}", "run.resume=true",
        f"model.checkpoint={out / 'pretrain' / 'checkpoint'}", f"optim.epochs={args.finetune_epochs}", *recipe])
    if not args.no_supervised:  # the same ViT from scratch, same total epochs and recipe (no layer decay)
        seconds["supervised"] = stage(out, "supervised", train["finetune"], [
            "--config", str(CONFIGS / "finetune_fashion_mnist.yaml"), f"run.output={out / 'supervised'}",
            "run.resume=true", *model, f"optim.epochs={args.pretrain_epochs + args.finetune_epochs}", *recipe])
    return seconds


def evaluation_stages(args: argparse.Namespace, evaluation: list[str], extra: list[str],
                      ort: tuple[Callable[[list[str]], Any], Callable[[list[str]], Any]]) -> dict[str, float]:
    """The evaluations of the fine-tuned and pretrained checkpoints, the ONNX export and its ONNX Runtime
    evaluation (``ort``: :func:`ort_stages`): seconds by stage."""
    from patchplace.pipelines import evaluate

    out, seconds = args.out, {}
    export_main, ort_evaluate_main = ort
    eval_extra = [o for o in args.overrides if o.startswith("eval.")]
    for name, checkpoint in (("evaluate_finetuned", "finetune"), ("evaluate_pretrained", "pretrain")):
        (out / name).mkdir(exist_ok=True)
        seconds[name] = stage(out, name, evaluate.main, [
            "--config", str(CONFIGS / "evaluate_fashion_mnist.yaml"), "run.overwrite=true", f"run.output={out / name}",
            f"model.checkpoint={out / checkpoint / 'checkpoint'}", *evaluation, *eval_extra])
    seconds["export"] = stage(out, "export", export_main, [
        str(out / "finetune" / "checkpoint"), "--out", str(out / "export" / "model.onnx")])
    val = next((o.split("=", 1)[1] for o in extra if o.startswith("data.val=")), "shards/fashion_mnist/test")
    seconds["evaluate_onnx"] = stage(out, "evaluate_onnx", ort_evaluate_main, [
        str(out / "export" / "model.onnx"), "--data", val, "--out", str(out / "evaluate_onnx"),
        "--checkpoint", str(out / "finetune" / "checkpoint"), "--robustness-limit", str(args.ort_robustness_limit),
        "--latency-repeats", str(args.ort_latency_repeats)])
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from patchplace.pipelines.engine.hardware import precision_line, resolve_precision

    ort = ort_stages()  # before any stage trains
    out = args.out
    # eval.* only reach the evaluations; the recipe and crop scale go first so that overrides win
    evaluation = ["data.scale=[0.8, 1.0]", *[o for o in args.overrides if not o.startswith("eval.")]]
    precision = resolve_precision(args.precision)
    print(f"[demo] {precision_line(precision)}" if args.precision == "auto" else
          f"[demo] --precision {args.precision} (forced)", flush=True)
    # the training stages name their precision unless float32 (a float32 stage's DONE record stays valid); a bf16
    # stage runs as a process of its own (Accelerate keeps one precision per process)
    extra = [*evaluation, *([f"run.mixed_precision={precision.value}"] if precision.value != "no" else [])]
    out.mkdir(parents=True, exist_ok=True)
    seconds = {**train_stages(args, extra), **evaluation_stages(args, evaluation, extra, ort)}
    loss_plot({"MP3 pretraining": out / "pretrain" / "log.jsonl", "fine-tuning": out / "finetune" / "log.jsonl"},
              out / "losses.png")
    for picture in ("mp3_position_accuracy.png", "mp3_reassembled.png"):
        if (out / "evaluate_pretrained" / picture).is_file():
            shutil.copy(out / "evaluate_pretrained" / picture, out / picture)
    text = report(out, seconds, precision)
    (out / "report.md").write_text(text)
    print(text)
    print(f"[demo] report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
