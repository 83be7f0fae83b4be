"""CIFAR-10 / CIFAR-100 "python version" batches -> WebDataset shards (32x32 RGB).

    python data/cifar.py --src ~/datasets/cifar-10-batches-py --out shards/cifar10
    python data/cifar.py --src ~/datasets/cifar-100-python --out shards/cifar100 [--labels coarse]

The batches are pickles. They are read with a restricted unpickler that only rebuilds dicts, lists, bytes and
numpy arrays, so a tampered file cannot run code.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np

from patchplace.data import DataError, Manifest
from patchplace.data.recipes import indexed_records, run_cli, write_image_splits
from patchplace.pipelines.datasets import parse

RECIPE_VERSION = 1
LAYOUTS = {  # variant -> (train files, test files, meta file, label-name key)
    "cifar10": ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], "batches.meta", b"label_names"),
    "cifar100": (["train"], ["test"], "meta", None),
}
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("_codecs", "encode"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def read_batch(path: Path) -> dict[bytes, Any]:
    if not path.is_file():
        raise DataError(f"missing {path}: pass --src to the extracted cifar-10-batches-py or cifar-100-python "
                        "folder")
    try:
        with open(path, "rb") as f:
            batch = _RestrictedUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise DataError(f"{path} is not a CIFAR python batch ({exc})") from exc
    if not isinstance(batch, dict):
        raise DataError(f"{path} is not a CIFAR python batch (expected a dict)")
    return batch


def detect_variant(src: Path) -> str:
    for variant, (train, _, meta, _) in LAYOUTS.items():
        if (src / meta).is_file() and (src / train[0]).is_file():
            return variant
    raise DataError(f"{src} holds neither CIFAR-10 (data_batch_1, batches.meta) nor CIFAR-100 (train, meta) "
                    "python batches: pass --src to the extracted folder")


def class_names(src: Path, variant: str, labels: str) -> list[str]:
    meta = read_batch(src / LAYOUTS[variant][2])
    key = LAYOUTS[variant][3] or (b"fine_label_names" if labels == "fine" else b"coarse_label_names")
    if key not in meta:
        raise DataError(f"{src / LAYOUTS[variant][2]} lacks {key.decode()}")
    return [n.decode() if isinstance(n, bytes) else str(n) for n in meta[key]]


def load_images(src: Path, files: list[str], labels: str) -> tuple[np.ndarray, np.ndarray]:
    images, targets = [], []
    for name in files:
        batch = read_batch(src / name)
        key = b"labels" if b"labels" in batch else (b"fine_labels" if labels == "fine" else b"coarse_labels")
        if b"data" not in batch or key not in batch:
            raise DataError(f"{src / name} lacks 'data' or '{key.decode()}'")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise DataError(f"{src / name}: data has shape {data.shape}, expected (N, 3072)")
        images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # rows are R, G, B planes
        targets.append(np.asarray(batch[key], dtype=np.int64))
    return np.concatenate(images), np.concatenate(targets)


def build(src: Path, out: Path, labels: str = "fine", max_count: int = 10_000, max_size: float = 256e6,
          progress: bool = True) -> dict[str, Manifest]:
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise DataError(f"missing {src}: download and extract CIFAR-10/100 (python version), then pass --src")
    variant = detect_variant(src)
    classes = class_names(src, variant, labels)
    train_files, test_files, _, _ = LAYOUTS[variant]
    data = {"train": load_images(src, train_files, labels), "test": load_images(src, test_files, labels)}
    records = {split: (indexed_records(images, targets), len(images)) for split, (images, targets) in data.items()}
    return write_image_splits(out, records, progress=progress,
                              dataset=variant if labels == "fine" else f"{variant}-coarse", classes=classes,
                              info={"image_size": [32, 32], "channels": 3}, source=str(src.resolve()),
                              recipe="cifar", recipe_version=RECIPE_VERSION, max_count=max_count,
                              max_size=max_size)


def main(argv: list[str] | None = None) -> int:
    """``python data/cifar.py``: the options of :func:`patchplace.pipelines.datasets.cifar_parser`."""
    return run(parse("cifar", argv))


def run(args: argparse.Namespace) -> int:
    return run_cli(lambda: build(args.src, args.out, args.labels, args.max_count, args.max_size))

if __name__ == "__main__":
    sys.exit(main())
