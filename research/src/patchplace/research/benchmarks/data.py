"""The data suite (shard reads per worker count, batched vs per-sample augmentation, MFCC) and the loader's
samples/s against what the study ViT's training consumes (data_vs_training, in --suite all). Rates are samples
(clips) per second measured in one process on whatever machine runs them: compare ratios from one run, not absolute
numbers across runs."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from patchplace.data import Manifest, ShardDataset, build_transform, make_loader
from patchplace.data.batched import BatchedImageAugment, crop_boxes
from patchplace.data.keyed_random import keyed_uniform
from patchplace.data.mfcc import MFCC
from patchplace.data.transforms import ImageTransform, ImageTransformConfig
from patchplace.research.benchmarks.common import STUDY, device_of


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
    if threads is not None:
        torch.set_num_threads(threads)
    frontend = MFCC().eval()
    signals = torch.randn(batch_size, int(16000 * seconds_per_clip)) * 0.1
    with torch.inference_mode():
        for _ in range(3):
            frontend(signals)
        start = time.perf_counter()
        for _ in range(batches):
            frontend(signals)
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
    for name, build in (extra or {}).items():  # e.g. kornia's (:func:`_kornia_crop`), when installed
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
