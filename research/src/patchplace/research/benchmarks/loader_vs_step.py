"""The loader_vs_step suite: does the streaming loader keep up with training at ImageNet sizes, on this machine?

On an ImageNet-like image-folder split — generated JPEGs of 64 px to 640 x 480 (data_writer's), written to shards by
the project's image-folder writer — the train loader exactly as the pipelines build it (``engine.build_data`` on
--loader-config, by default DeiT's recipe, "Training data-efficient image transformers & distillation through
attention", arXiv 2012.12877: RandomResizedCrop 224 + flip + RandAugment rand-m9-mstd0.5-inc1 + random erasing, 3
repeated augmentations): images/s, the fastest of --loader-repeats epochs, with each --loader-workers count and each
JPEG decoder (pillow: Pillow for every JPEG; fast: torchvision's decode_jpeg where it gives Pillow's pixels).
Beside it, the supervised training step (forward + backward + AdamW) of --step-preset at the same batch and 224 px
on the same machine. Ratio = loader / step images/s: >= 1, the loader keeps up. Measured apart: in training both
share the machine's cores."""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from patchplace.research.benchmarks.common import device_of
from patchplace.research.benchmarks.report import TABLES

CLASSES = 1000  # the head of an ImageNet-1K model (the step's cost; the generated split has 10 classes)
TABLES["loader_vs_step"] = (  # this suite's table in benchmark.md (report.py holds the other suites')
    "Streaming loader (ImageNet recipe, 224 px) vs the training step at the same batch, same machine; measured "
    "apart", [("benchmark", "name"), ("decoder", "decoder"), ("workers", "workers"),
              ("loader images/s", "loader_images_per_s"), ("steady images/s", "steady_images_per_s"),
              ("first batch s", "first_batch_s"), ("step images/s", "step_images_per_s"), ("step ms", "step_ms"),
              ("ratio", "ratio"), ("keeps up", "keeps_up"), ("workers needed", "workers_needed"),
              ("pinned", "pin_memory"), ("batch", "batch"), ("images", "images"), ("device", "device")])


@dataclass
class _Host:
    """What ``build_data`` reads of an Accelerator (its device, rank, world size and print), for one process."""

    device: torch.device
    process_index: int = 0
    num_processes: int = 1
    printed: list[str] = field(default_factory=list)

    def print(self, *args: Any) -> None:
        self.printed.append(" ".join(map(str, args)))


def write_split(root: Path, images: int) -> Path:
    """``images`` generated JPEGs of varying sizes, written to shards by the image-folder recipe: the train split."""
    from patchplace.pipelines.datasets import image_folder
    from patchplace.research.benchmarks.data_writer import write_jpegs

    write_jpegs(root / "folder", images)
    image_folder.build(root / "folder", root / "shards", splits=("train",), stats_samples=64,
                       max_count=max(1, images // 4), progress=False)
    return root / "shards" / "train"


def loader_throughput(split: Path, config: str, workers: int, batch: int, device: torch.device, decoder: str
                      ) -> dict[str, Any]:
    """Images/s of one epoch of ``config``'s train loader over ``split`` (decode + augmentation + collation, the
    batch copied to ``device`` as training does), with ``workers`` DataLoader workers and JPEG ``decoder``."""
    from patchplace.data import codecs
    from patchplace.pipelines import engine
    from patchplace.pipelines.config import load
    from patchplace.pipelines.pretrain import PretrainConfig

    cfg = load(PretrainConfig, config, [f"data.train={split}", f"data.val={split}", f"data.batch_size={batch}",
                                        f"data.num_workers={workers}", "data.in_memory=false"]).data
    fast = codecs.FAST_JPEG
    codecs.FAST_JPEG = decoder == "fast"  # the workers fork from here, with this value
    try:
        host = _Host(torch.device(device))
        reader = engine.build_data(cfg, host, seed=0).train
        start, first, seen = time.perf_counter(), None, 0
        for x, _ in reader.batches(batch, epoch=0):
            x.to(host.device, non_blocking=True)
            seen += len(x)
            first = first or (time.perf_counter(), seen)
        if host.device.type == "cuda":
            torch.cuda.synchronize(host.device)
        end = time.perf_counter()
    finally:
        codecs.FAST_JPEG = fast
    steady = (seen - first[1]) / (end - first[0]) if seen > first[1] else None
    return {"name": f"loader/{decoder}/workers={workers}", "decoder": decoder, "workers": workers, "images": seen,
            "batch": batch, "seconds": round(end - start, 3), "first_batch_s": round(first[0] - start, 3),
            "loader_images_per_s": round(seen / (end - start), 1),
            "steady_images_per_s": None if steady is None else round(steady, 1),
            "pin_memory": reader.pin_memory, "config": config}


def step_throughput(preset: str, batch: int, device: str, amp: str, repeats: int) -> dict[str, Any]:
    """The supervised training step's images/s of ``preset`` at 224 px, 3 channels, ``batch``, on ``device``."""
    from patchplace.research.benchmarks.steps import default_objectives, step_times

    builders = default_objectives(preset, in_chans=3, num_classes=CLASSES, img_size=224, widths="paper")
    row = step_times({"supervised": builders["supervised"]}, batch=batch, num_classes=CLASSES, repeats=repeats,
                     warmup=1, device=device, amp=amp)[0]
    return {"name": f"step/{preset}/supervised", "preset": preset, "batch": batch, "step_ms": row["step_ms"],
            "step_images_per_s": row["samples_per_s"], "device": row["device"], "amp": amp,
            "threads": row["threads"]}


def compared(loaders: list[dict[str, Any]], step: dict[str, Any]) -> list[dict[str, Any]]:
    """Each loader row with its ratio to the step (>= 1: keeps up) and, from the same decoder's 1-worker rate, the
    workers a loader would need to feed this step (each on a core of its own)."""
    one = {r["decoder"]: r["loader_images_per_s"] for r in loaders if r["workers"] == 1}
    rows = []
    for r in loaders:
        ratio = r["loader_images_per_s"] / step["step_images_per_s"]
        per_worker = one.get(r["decoder"])
        rows.append({**r, "step_images_per_s": step["step_images_per_s"], "step_preset": step["preset"],
                     "ratio": round(ratio, 2), "keeps_up": ratio >= 1,
                     "workers_needed": math.ceil(step["step_images_per_s"] / per_worker) if per_worker else None})
    return rows


def loader_vs_step_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    device = device_of(args)
    step = step_throughput(args.step_preset, args.loader_step_batch, device, args.amp or "no",
                           args.step_repeats)
    print(json.dumps(step), flush=True)
    loaders = []
    with tempfile.TemporaryDirectory(prefix="loader_vs_step_") as tmp:
        split = write_split(Path(tmp), args.loader_images)
        for workers in args.loader_workers:
            best: dict[str, dict[str, Any]] = {}
            for _ in range(args.loader_repeats):  # decoders alternated, the fastest epoch kept: a busy machine
                for decoder in args.loader_decoders:  # slows a run, never speeds it
                    row = loader_throughput(split, args.loader_config, workers, args.loader_step_batch,
                                            torch.device(device), decoder)
                    if decoder not in best or row["loader_images_per_s"] > best[decoder]["loader_images_per_s"]:
                        best[decoder] = {**row, "epochs": args.loader_repeats}
            for row in best.values():
                loaders.append(row)
                print(json.dumps(row), flush=True)
    rows = [step, *compared(loaders, step)]
    return [{**row, "suite": "loader_vs_step", "cpu_count": os.cpu_count()} for row in rows]
