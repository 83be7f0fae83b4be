"""Benchmarks: speed and memory figures live here, never in timed tests.

    python pipelines/benchmark.py --suite data --out runs/benchmark

Writes ``<out>/benchmark.json`` and ``<out>/benchmark.md``. Suites: ``data`` (shard read throughput with 0 and
2 DataLoader workers, decode + train transform included; MFCC frontend clips/s); ``models`` (one block's
forward + backward with MP3 context-only keys/values vs full attention, time ratio beside FLOP ratio);
``objectives`` (pretraining step time of every objective relative to the supervised step of the same ``vit_cpu``
backbone and batch, beside each FLOP ratio); ``pipelines`` (end-to-end samples/s of every Fashion-MNIST
pretraining config through ``pretrain.py`` and the data loader's share of step time; needs the shards).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))  # pretrain.py / engine.py / config.py

from patchplace.data.benchmark import mfcc_throughput, shard_read_throughput
from patchplace.models.benchmark import context_attention
from patchplace.objectives.benchmark import default_objectives, step_times


def data_suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for workers in args.workers:
        rows.append(shard_read_throughput(args.shards, num_workers=workers, max_samples=args.max_samples,
                                          pad_to=args.pad_to))
        print(json.dumps(rows[-1]))
    rows.append(mfcc_throughput(batch_size=64, batches=args.mfcc_batches))
    print(json.dumps(rows[-1]))
    return rows


def models_suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for eta in args.etas:
        rows.append(context_attention(eta=eta, batch=args.batch))
        print(json.dumps(rows[-1]))
    return rows


def objectives_suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = step_times(default_objectives(), batch=args.batch, repeats=args.repeats)
    for row in rows:
        print(json.dumps(row))
    return rows


def pipelines_suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    """End-to-end training throughput of every Fashion-MNIST pretraining config through pretrain.py (data loading,
    transforms, Accelerate, optimizer, EMA), and the share of step time spent waiting for the data loader."""
    import tempfile

    import pretrain

    rows = []
    configs = sorted((Path(__file__).parent / "configs").glob("*_fashion_mnist.yaml"))
    for config in (c for c in configs if not c.name.startswith(("finetune", "evaluate"))):
        with tempfile.TemporaryDirectory() as tmp:
            code = pretrain.main(["--config", str(config), f"optim.max_steps={args.steps}",
                                  f"data.batch_size={args.batch}", f"run.output={tmp}", "run.tensorboard=false",
                                  f"run.log_every={args.steps}", "run.checkpoint_every=0"])
            if code != 0:
                raise SystemExit(f"{config.name} failed")
            last = [json.loads(line) for line in (Path(tmp) / "log.jsonl").read_text().splitlines()][-1]
        rows.append({"name": f"train/{config.stem}", "samples_per_s": last["samples_per_s"],
                     "data_share": last["data_share"], "steps": args.steps, "batch": args.batch,
                     "threads": torch.get_num_threads()})
        print(json.dumps(rows[-1]))
    return rows


SUITES = {"data": data_suite, "models": models_suite, "objectives": objectives_suite,
          "pipelines": pipelines_suite}


UNITS = (("samples_per_s", "samples/s"), ("clips_per_s", "clips/s"), ("time_vs_full", "x full attention"),
         ("time_vs_supervised", "x supervised step"))


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| benchmark | result | detail |", "| --- | --- | --- |"]
    for row in rows:
        key, unit = next((k, u) for k, u in UNITS if k in row)
        detail = ", ".join(f"{k}={v}" for k, v in row.items() if k not in {"name", key})
        lines.append(f"| {row['name']} | {row[key]} {unit} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), default="data", help="what to measure (default: data)")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmark"), help="output directory")
    parser.add_argument("--shards", type=Path, default=Path("shards/fashion_mnist/train"),
                        help="split read by the data suite (default: %(default)s)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts")
    parser.add_argument("--max-samples", type=int, default=None, help="stop each read after this many samples")
    parser.add_argument("--pad-to", type=int, default=32, help="image padding used by the transform")
    parser.add_argument("--mfcc-batches", type=int, default=20, help="timed MFCC batches of 64 clips")
    parser.add_argument("--etas", type=float, nargs="+", default=[0.5, 0.75], help="models suite: masking ratios")
    parser.add_argument("--batch", type=int, default=128, help="models / objectives suites: batch size")
    parser.add_argument("--repeats", type=int, default=10, help="objectives suite: timed steps per objective")
    parser.add_argument("--steps", type=int, default=20, help="pipelines suite: optimizer steps per method")
    args = parser.parse_args(argv)
    rows = SUITES[args.suite](args)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"suite": args.suite, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "python": platform.python_version()}
    (args.out / "benchmark.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    (args.out / "benchmark.md").write_text(to_markdown(rows))
    print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
