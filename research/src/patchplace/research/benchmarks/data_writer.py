"""The data_writer suite: the image-folder recipe's shard writer (images/s, per core, for each --writer-workers
count; the outputs compared byte for byte) and JPEG decoding per core: Pillow vs torchvision.io.decode_jpeg, and
the reader's decode path before (Pillow) and after (decode_jpeg where it gives Pillow's pixels), with the largest
pixel difference of each pair, on generated JPEGs of varying sizes (ImageNet-like: 64 px to 640 x 480).
Rates are one run's, on whatever machine runs it: compare within a run."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

SIZES = [(64, 64), (160, 120), (256, 256), (375, 500), (480, 640)]  # (H, W), cycled
CLASSES = 10


def write_jpegs(root: Path, n: int, seed: int = 0) -> list[Path]:
    """``n`` JPEGs (quality 90, smooth gradients + noise, so they compress like photos) in ``root/train/<class>/``."""
    rng = np.random.default_rng(seed)
    files = []
    for i in range(n):
        h, w = SIZES[i % len(SIZES)]
        folder = root / "train" / f"n{i % CLASSES:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        yy, xx = np.mgrid[0:h, 0:w]
        base = rng.uniform(40, 200, 3) + 40 * np.sin(xx[..., None] / rng.uniform(8, 40, 3) + yy[..., None] / 23)
        pixels = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        files.append(folder / f"img{i:06d}.JPEG")
        Image.fromarray(pixels).save(files[-1], quality=90)
    return files


def _tree(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.rglob("*"))
            if f.is_file()}


def writer_throughput(src: Path, out: Path, workers: int, images: int) -> tuple[dict[str, Any], dict[str, str]]:
    from patchplace.pipelines.datasets import image_folder

    start = time.perf_counter()
    image_folder.build(src, out, splits=("train",), stats_samples=64, max_count=max(1, images // 8),
                       progress=False, workers=workers)
    seconds = time.perf_counter() - start
    cores = min(workers, os.cpu_count() or 1)
    rate = images / seconds
    return {"name": f"writer/image_folder/workers={workers}", "images": images, "workers": workers,
            "seconds": round(seconds, 3), "images_per_s": round(rate, 1),
            "images_per_s_per_core": round(rate / cores, 1)}, _tree(out)


def decoder_throughput(files: list[Path], repeats: int = 3) -> list[dict[str, Any]]:
    """Images/s of one thread decoding every file to RGB uint8 (the fastest of ``repeats`` interleaved passes):
    plain Pillow and torchvision.io.decode_jpeg, then the project's decode path before (``decode_with_pillow``:
    Pillow for every JPEG) and after (``decode_image_bytes``: decode_jpeg where its pixels are
    Pillow's), each pair's largest pixel difference."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from patchplace.data.codecs import decode_image_bytes, decode_with_pillow

    blobs = [f.read_bytes() for f in files]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def pil(data: bytes) -> np.ndarray:
            with Image.open(io.BytesIO(data)) as img:
                return np.asarray(img.convert("RGB"))

        def tv(data: bytes) -> np.ndarray:
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return decode_jpeg(raw, mode=ImageReadMode.RGB).permute(1, 2, 0).numpy()

        decoders = {"pil": pil, "torchvision": tv, "project/before (Pillow)": lambda b: decode_with_pillow(b, 3),
                    "project/after (decode_jpeg where exact)": lambda b: decode_image_bytes(b, 3)}
        with warnings.catch_warnings():  # torchvision 0.29's deprecation note, once per decode_jpeg call
            warnings.simplefilter("ignore", DeprecationWarning)
            outputs = {name: [np.asarray(fn(b)) for b in blobs] for name, fn in decoders.items()}  # + warm-up
            passes: dict[str, list[float]] = {name: [] for name in decoders}
            for _ in range(repeats):  # interleaved passes, the fastest kept: a busy machine slows, never speeds
                for name, fn in decoders.items():
                    start = time.perf_counter()
                    for b in blobs:
                        fn(b)
                    passes[name].append(time.perf_counter() - start)
        rows = [{"name": f"decode/{name}", "images": len(blobs), "passes": repeats, "seconds": round(min(t), 3),
                 "images_per_s_per_core": round(len(blobs) / min(t), 1)} for name, t in passes.items()]
        names = list(decoders)
        for first, second in ((0, 1), (2, 3)):  # plain Pillow vs decode_jpeg; the reader before vs after
            pairs = zip(outputs[names[first]], outputs[names[second]], strict=True)
            diffs = [int(np.abs(x.astype(np.int16) - y.astype(np.int16)).max()) for x, y in pairs]
            for row in (rows[first], rows[second]):
                row.update(max_abs_diff=max(diffs), identical_images=f"{sum(d == 0 for d in diffs)}/{len(diffs)}")
            speedup = rows[second]["images_per_s_per_core"] / rows[first]["images_per_s_per_core"]
            rows[second]["vs_pil"] = round(speedup, 2)  # the report's "vs Pillow" column
        return rows
    finally:
        torch.set_num_threads(threads)


def data_writer_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="data_writer_") as tmp:
        src = Path(tmp) / "folder"
        files = write_jpegs(src, args.writer_images)
        trees = {}
        for workers in args.writer_workers:
            row, trees[workers] = writer_throughput(src, Path(tmp) / f"out{workers}", workers, len(files))
            rows.append(row)
        first = trees[args.writer_workers[0]]
        for row in rows:
            row["identical_to_first"] = trees[row["workers"]] == first
            print(json.dumps(row), flush=True)
        for row in decoder_throughput(files):
            rows.append(row)
            print(json.dumps(row), flush=True)
    sizes = ", ".join(f"{h}x{w}" for h, w in SIZES)
    return [{**row, "suite": "data_writer", "jpeg_sizes": sizes} for row in rows]
