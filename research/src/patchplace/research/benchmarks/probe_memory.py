"""The probe_memory suite: peak anonymous memory (RssAnon, sampled from /proc/self/status) of pipelines/evaluate.py
with streamed probes over the whole train split, at each --probe-sizes train-split size (generated 16 px gray shards,
10 classes; a 4-block vit_micro): features extracted batch by batch into the store on disk, the linear probe of
the last layer and of the last-4 concatenation, StoP's 1% logistic regression and the layer-wise kNN. Each size runs
in a fresh process with no DataLoader worker (everything it reads is counted); the store's file-backed pages are not
anonymous memory. Flat = memory independent of the split's size. Each size runs twice: with glibc's default
allocator, whose dynamic mmap threshold keeps freed large buffers in the heap (a few MB more the more batches a run
allocates), and with that threshold fixed (MALLOC_MMAP_THRESHOLD_=131072, glibc's initial value: freed large buffers
go back to the system), which shows what the evaluation itself holds.

The feature-width axis (--feature-dims, e.g. ViT-B's 768, its 3,072-d last-4 concatenation and ViT-H's 5,120):
a store of --width-samples train and VAL val samples of that width (class-separated Gaussian rows, every feature
``last`` / ``last4`` / ``block1`` that wide) written through the evaluation's writer and merge, then read by the
evaluation's own probes (evaluate.frozen_probes: both linear probes, StoP's 1% logistic regression and a logistic
regression on half the labels; the kNN of evaluation.knn_per_layer), in a fresh process each; no model is loaded,
so the RssAnon is the probes' alone. Bounded = growing with the width for the heads' weights and a chunk, not with
the rows."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CLASSES, SIDE, VAL = 10, 16, 1000
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc's initial threshold, kept fixed

# what each measured process runs: a sampler thread keeps the largest RssAnon while evaluate.py runs
DRIVER = """
import json, sys, threading, time
from patchplace.pipelines import evaluate

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak, done = [anon()], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.005)
before = anon()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
code = evaluate.main(sys.argv[1:])
seconds = time.perf_counter() - start
done.set()
thread.join()
print(json.dumps({"code": code, "before": before, "peak": max(peak[0], anon()), "seconds": seconds}))
"""


# the width axis: a store of one width written and probed in a fresh process (argv: folder, rows, dim, epochs)
WIDTH_DRIVER = DRIVER.split("before = anon()")[0] + """
import numpy as np, torch
from pathlib import Path
from patchplace.finetune import FeatureStore, FeatureWriter, merge_parts
from patchplace.pipelines.commands import EvaluateConfig
from patchplace.pipelines.config import build
from patchplace.pipelines.evaluate import Stores, frozen_probes
from patchplace.pipelines.evaluation import Ranks, knn_per_layer

folder, rows, dim, epochs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
names, classes = ["last", "last4", "block1"], 10
centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0))

def store(split, n, seed):
    g = torch.Generator().manual_seed(seed)
    with FeatureWriter(folder / split, 0) as writer:
        for start in range(0, n, 256):
            y = torch.arange(start, min(start + 256, n)) % classes
            x = centers[y] + 4 * torch.randn(len(y), dim, generator=g)
            writer.append({name: x for name in names}, y, torch.arange(start, start + len(y)),
                          [str(i) for i in range(start, start + len(y))])
    merge_parts(folder / split, 1, n, split)
    return FeatureStore(folder / split)

cfg = build(EvaluateConfig, {"eval.probe_layers": ["last", "last4"], "eval.probe_epochs": epochs,
                             "eval.label_probe": "logistic", "eval.low_label_fraction": 0.01,
                             "eval.label_fractions": [0.5]})
before = anon()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
train, val = store("train", rows, 1), store("val", VAL, 2)
stores = Stores(train, val, np.arange(rows))
results = frozen_probes(cfg, stores, classes, "cpu")
knn = knn_per_layer(train, stores.probe, val, 1, classes, Ranks(), "cpu")
seconds = time.perf_counter() - start
done.set()
thread.join()
print(json.dumps({"code": 0, "before": before, "peak": max(peak[0], anon()), "seconds": seconds,
                  "linear_probe_top1": results["linear_probe"]["top1"], "knn_top1": knn[1],
                  "half_labels_logistic_top1": results["linear_probe_label_fraction"]["0.5"]["top1"]}))
""".replace("VAL, 2", f"{VAL}, 2")


def write_split(root: Path, split: str, n: int, seed: int) -> Path:
    """``n`` 16 px gray images of 10 classes (each its own brightness under noise), 1000 per shard."""
    from patchplace.data import SplitWriter

    rng = np.random.default_rng(seed)
    with SplitWriter(root, split, dataset="probe_memory", modality="image", classes=[f"c{i}" for i in range(CLASSES)],
                     info={"image_size": [SIDE, SIDE], "channels": 1}, source="generated", recipe="probe_memory",
                     recipe_version=1, max_count=1000) as writer:
        for i in range(n):
            level = 20 + 22 * (i % CLASSES)
            pixels = np.clip(rng.normal(level, 25, (SIDE, SIDE)), 0, 255).astype(np.uint8)
            writer.add_image(f"{i:07d}", i % CLASSES, pixels)
    return root / split


def make_checkpoint(path: Path) -> Path:
    """A randomly initialised 4-block vit_micro for 16 px gray images (its probes read the patch mean)."""
    import torch

    from patchplace.models import create_model

    torch.manual_seed(0)
    create_model("vit_micro", img_size=SIDE, patch_size=4, in_chans=1, depth=4).save_pretrained(
        path, metadata={"probe_feature": "mean"})
    return path


def measure(train: Path, val: Path, checkpoint: Path, out: Path, epochs: int, env: dict[str, str] | None = None
            ) -> dict[str, Any]:
    args = [f"data.train={train}", f"data.val={val}", "data.in_memory=false", "data.num_workers=0",
            "data.batch_size=256", "data.pad_to=null", f"data.img_size={SIDE}", f"model.checkpoint={checkpoint}",
            "eval.probe_train_samples=0",
            "eval.probe_layers=[last,last4]", f"eval.probe_epochs={epochs}", "eval.label_probe=logistic",
            "eval.low_label_fraction=0.01", "eval.position_probe=false", "eval.max_eval_samples=8",
            "eval.keep_features=true", f"run.output={out}"]
    result = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=3600,
                            env={**os.environ, **(env or {})})
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines or json.loads(lines[-1])["code"]:
        raise RuntimeError(f"evaluate.py failed: {result.stderr[-2000:]}")
    found = json.loads(lines[-1])
    store = sum(f.stat().st_size for f in (out / "features").rglob("*.npy"))
    results = json.loads((out / "results.json").read_text())
    return {"peak_rss_anon_mb": round(found["peak"] / 2**20, 1),
            "added_rss_anon_mb": round((found["peak"] - found["before"]) / 2**20, 1),
            "store_mb": round(store / 2**20, 1), "seconds": round(found["seconds"], 1),
            "linear_probe_top1": round(results["linear_probe"]["top1"], 4),
            "knn_top1_last": round(results["knn_per_layer"]["4"], 4)}


def measure_width(folder: Path, rows: int, dim: int, epochs: int) -> dict[str, Any]:
    """Peak RssAnon of a ``rows`` x ``dim`` store written and probed (:data:`WIDTH_DRIVER`), glibc's mmap
    threshold fixed."""
    result = subprocess.run([sys.executable, "-c", WIDTH_DRIVER, str(folder), str(rows), str(dim), str(epochs)],
                            capture_output=True, text=True, timeout=3600, env={**os.environ, **FIXED_MMAP})
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        raise RuntimeError(f"the width driver failed: {result.stderr[-2000:]}")
    found = json.loads(lines[-1])
    store = sum(f.stat().st_size for f in folder.rglob("*.npy"))
    return {"name": f"probes/store/width={dim}", "train_samples": rows, "val_samples": VAL, "feature_dim": dim,
            "probe_epochs": epochs, "store_mb": round(store / 2**20, 1),
            "peak_rss_anon_fixed_mmap_mb": round(found["peak"] / 2**20, 1),
            "added_rss_anon_fixed_mmap_mb": round((found["peak"] - found["before"]) / 2**20, 1),
            "seconds": round(found["seconds"], 1), "linear_probe_top1": round(found["linear_probe_top1"], 4),
            "half_labels_logistic_top1": round(found["half_labels_logistic_top1"], 4),
            "knn_top1": round(found["knn_top1"], 4)}


def width_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The feature-width axis (--feature-dims at --width-samples train samples)."""
    rows = []
    for dim in getattr(args, "feature_dims", None) or []:
        with tempfile.TemporaryDirectory(prefix="probe_width_") as tmp:
            row = measure_width(Path(tmp), getattr(args, "width_samples", 8000), dim, args.probe_epochs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def probe_memory_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = width_rows(args)
    with tempfile.TemporaryDirectory(prefix="probe_memory_") as tmp:
        root = Path(tmp)
        val = write_split(root / "val", "val", VAL, seed=1)
        checkpoint = make_checkpoint(root / "checkpoint")
        for n in args.probe_sizes:
            start = time.perf_counter()
            train = write_split(root / f"train{n}", "train", n, seed=0)
            written = time.perf_counter() - start
            fixed = measure(train, val, checkpoint, root / f"fixed{n}", args.probe_epochs, FIXED_MMAP)
            row = {"name": f"evaluate/streamed/train={n}", "train_samples": n, "val_samples": VAL,
                   "probe_epochs": args.probe_epochs, "split_written_s": round(written, 1),
                   **measure(train, val, checkpoint, root / f"ev{n}", args.probe_epochs),
                   "peak_rss_anon_fixed_mmap_mb": fixed["peak_rss_anon_mb"],
                   "added_rss_anon_fixed_mmap_mb": fixed["added_rss_anon_mb"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return [{**row, "suite": "probe_memory"} for row in rows]
