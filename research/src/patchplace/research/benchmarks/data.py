"""The data suite (shard reads per worker count, batched vs per-sample augmentation, MFCC) and the loader's
samples/s against what the study ViT's training consumes (data_vs_training, in --suite all)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from patchplace.data.benchmark import augment_throughput, mfcc_throughput, shard_read_throughput
from patchplace.research.benchmarks.common import STUDY, device_of


def _kornia_crop() -> dict[str, Any]:
    """kornia's batched crop-and-resize as an augment_throughput candidate, when kornia is installed (it is not a
    dependency: it was measured to choose the in-memory path's sampler)."""
    try:
        from kornia.geometry.transform import crop_and_resize
    except ImportError:
        return {}

    def build(padded, top, left, h, w):
        corners = torch.stack([torch.stack([left, top], 1), torch.stack([left + w - 1, top], 1),
                               torch.stack([left + w - 1, top + h - 1], 1), torch.stack([left, top + h - 1], 1)],
                              1).float()
        side = padded.shape[-1]
        return lambda: crop_and_resize(padded, corners, (side, side))

    return {"kornia crop_and_resize (bilinear)": build}


def data_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    if not (args.shards / "manifest.json").is_file():
        print(f"data: no shards at {args.shards} (python data/fashion_mnist.py --out shards/fashion_mnist): "
              "shard reads skipped", flush=True)
    else:
        for workers in args.workers:
            rows.append(shard_read_throughput(args.shards, num_workers=workers, batch_size=args.loader_batch,
                                              max_samples=args.max_samples, pad_to=args.pad_to))
            print(json.dumps(rows[-1]), flush=True)
    for row in augment_throughput(batch_size=args.loader_batch, pad_to=args.pad_to, device=device_of(args),
                                  extra=_kornia_crop()):
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append(mfcc_throughput(batch_size=64, batches=args.mfcc_batches))
    print(json.dumps(rows[-1]), flush=True)
    return [{**row, "suite": "data"} for row in rows]


def data_vs_training(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Loader samples/s (each worker count) against the samples/s the study ViT's training consumes: supervised,
    and the fastest objective (the hardest to feed). Headroom = loader / consumption (> 1: the loader keeps up when
    it has cores of its own; in training both share them, see the pipelines suite's data-wait share)."""
    loaders = [r for r in rows if r.get("suite") == "data" and r["name"].startswith("shard_read")]
    training = {r["name"].split("/", 1)[1]: r["samples_per_s"] for r in rows if r.get("suite") == "objectives"
                and r.get("preset") == STUDY["preset"] and not r["name"].endswith(("_before", "+compile"))}
    if not loaders or "supervised" not in training:
        return []
    fastest = max(training, key=training.get)
    return [{"name": f"data_vs_training/workers={loader['num_workers']}", "num_workers": loader["num_workers"],
             "loader_samples_per_s": loader["samples_per_s"], "supervised_samples_per_s": training["supervised"],
             "headroom_supervised": round(loader["samples_per_s"] / training["supervised"], 2),
             "fastest_objective": fastest, "fastest_samples_per_s": training[fastest],
             "headroom_fastest": round(loader["samples_per_s"] / training[fastest], 2), "suite": "data_vs_training"}
            for loader in loaders]
