"""Data-path benchmarks (called by ``pipelines/benchmark.py``): shard read throughput and MFCC throughput.

Numbers are samples (clips) per second measured in one process on whatever machine runs them; compare ratios
from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .manifest import Manifest
from .reader import ShardDataset, make_loader
from .transforms import build_transform


def shard_read_throughput(split_dir: str | Path, *, num_workers: int, batch_size: int = 256,
                          max_samples: int | None = None, train: bool = True, **transform_options: Any
                          ) -> dict[str, Any]:
    """Samples/s reading a split through ShardDataset + DataLoader, decode and (train) transform included."""
    manifest = Manifest.load(split_dir)
    dataset = ShardDataset(manifest, transform=build_transform(manifest, train=train, **transform_options),
                           shuffle_buffer=1000, seed=0, num_workers=num_workers)
    start, seen = time.perf_counter(), 0
    for inputs, _ in make_loader(dataset, batch_size):
        seen += len(inputs)
        if max_samples is not None and seen >= max_samples:
            break
    seconds = time.perf_counter() - start
    return {"name": f"shard_read/{manifest.dataset}/{manifest.split}/workers={num_workers}",
            "samples": seen, "seconds": round(seconds, 3), "samples_per_s": round(seen / seconds, 1),
            "num_workers": num_workers, "batch_size": batch_size, "train_transform": train}


def mfcc_throughput(*, batch_size: int = 64, batches: int = 20, seconds_per_clip: float = 1.0,
                    threads: int | None = None) -> dict[str, Any]:
    """1 s clips/s through the MFCC frontend (forward only, float32, CPU)."""
    from .mfcc import MFCC

    if threads is not None:
        torch.set_num_threads(threads)
    frontend = MFCC().eval()
    waves = torch.randn(batch_size, int(16000 * seconds_per_clip)) * 0.1
    with torch.inference_mode():
        for _ in range(3):
            frontend(waves)
        start = time.perf_counter()
        for _ in range(batches):
            frontend(waves)
        seconds = time.perf_counter() - start
    clips = batch_size * batches
    return {"name": "mfcc_frontend", "clips": clips, "seconds": round(seconds, 3),
            "clips_per_s": round(clips / seconds, 1), "batch_size": batch_size,
            "threads": torch.get_num_threads()}
