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


def augment_throughput(*, batch_size: int = 128, side: int = 28, pad_to: int = 32, repeats: int = 20,
                       device: str = "cpu", extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Images/s of the candidate ways to random-resized-crop a batch with per-sample boxes (why
    :mod:`patchplace.data.batched` uses ``grid_sample``), beside the in-memory path's whole augmentation and the
    streaming path's per-sample timm / PIL transform. ``extra``: more candidates, ``name -> build(padded float
    images, top, left, h, w) -> callable``."""
    import torch.nn.functional as F
    import torchvision.transforms.v2.functional as TF
    from torchvision.ops import roi_align
    from torchvision.transforms.functional import to_pil_image

    from .batched import BatchedImageAugment, crop_boxes
    from .keyed_random import keyed_uniform
    from .transforms import ImageTransform, ImageTransformConfig

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, 1, side, side), dtype=torch.uint8, generator=g)
    padded = F.pad(images.float(), [(pad_to - side) // 2] * 4).to(device)
    top, left, h, w = (t.to(device) for t in crop_boxes(keyed_uniform(0, 0, torch.arange(batch_size), 22), pad_to,
                                                        pad_to, (0.35, 1.0), (3 / 4, 4 / 3)))

    def grid(mode: str) -> torch.Tensor:
        theta = torch.zeros(batch_size, 2, 3, device=device)
        theta[:, 0, 0], theta[:, 0, 2] = w / pad_to, (2 * left + w) / pad_to - 1
        theta[:, 1, 1], theta[:, 1, 2] = h / pad_to, (2 * top + h) / pad_to - 1
        coords = F.affine_grid(theta, [batch_size, 1, pad_to, pad_to], align_corners=False)
        return F.grid_sample(padded, coords, mode=mode, padding_mode="border", align_corners=False)

    def roi() -> torch.Tensor:
        boxes = torch.stack([torch.arange(batch_size, device=device).float(), left, top, left + w, top + h], 1)
        return roi_align(padded, boxes.float(), (pad_to, pad_to), sampling_ratio=2, aligned=True)

    def v2_loop() -> torch.Tensor:
        return torch.stack([TF.resized_crop(padded[k], int(top[k]), int(left[k]), int(h[k]), int(w[k]),
                                            [pad_to, pad_to], interpolation=TF.InterpolationMode.BICUBIC)
                            for k in range(batch_size)])

    candidates = {"grid_sample bicubic (ours)": lambda: grid("bicubic"),
                  "grid_sample bilinear": lambda: grid("bilinear"), "torchvision roi_align (bilinear)": roi,
                  "torchvision v2 resized_crop per sample": v2_loop}
    for name, build in (extra or {}).items():  # e.g. kornia's, timed by pipelines/benchmark.py when installed
        candidates[name] = build(padded, top, left, h, w)
    fake = _FakeManifest(side, {"mean": [0.5], "std": [0.25]})
    ours = BatchedImageAugment(fake, True, ImageTransformConfig(pad_to=pad_to, re_prob=0.25)).to(device)
    on_device, index = images.to(device), torch.arange(batch_size, device=device)
    candidates["in-memory path: pad + crop + flip + normalize + erase"] = lambda: ours(on_device, index, 0, 0)
    timm_transform = ImageTransform(fake, True, ImageTransformConfig(pad_to=pad_to, re_prob=0.25))
    candidates["streaming path: timm / PIL per sample"] = lambda: torch.stack(
        [timm_transform.timm(to_pil_image(F.pad(x, [(pad_to - side) // 2] * 4))) for x in images])
    rows = []
    for name, fn in candidates.items():
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / repeats
        rows.append({"name": f"augment/{name}", "samples_per_s": round(batch_size / seconds, 1),
                     "batch_size": batch_size, "seconds": round(seconds, 5), "device": device,
                     "threads": torch.get_num_threads()})
    return rows


class _FakeManifest:
    """What the transforms read from a manifest, for timing without shards."""

    def __init__(self, side: int, normalization: dict[str, list[float]]) -> None:
        self.dataset, self.split, self.modality = "bench", "train", "image"
        self.info = {"image_size": [side, side], "channels": 1}
        self.normalization = normalization
