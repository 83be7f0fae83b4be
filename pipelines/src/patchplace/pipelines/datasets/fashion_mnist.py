"""Fashion-MNIST IDX files -> WebDataset shards (train 60k / test 10k, 28x28 gray, 10 classes).

Reads the IDX ``.gz`` files of the Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/
fashion-mnist``) or any directory with the same four files (``--src``). Normalization statistics are computed
on the train split and written into both manifests.

    python data/fashion_mnist.py --out shards/fashion_mnist
"""

from __future__ import annotations

import argparse
import gzip
import struct
import sys
from pathlib import Path

import numpy as np

from patchplace.data import DataError, Manifest
from patchplace.data.recipes import indexed_records, run_cli, write_image_splits
from patchplace.pipelines.datasets import FASHION_MNIST_SRC, parse

RECIPE_VERSION = 1
DEFAULT_SRC = FASHION_MNIST_SRC
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
           "Ankle boot")
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
_IDX_UBYTE = 0x08


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped) of unsigned bytes: magic 0 0 0x08 ndim, big-endian dims, data."""
    if not path.is_file():
        raise DataError(f"missing {path}: run `apt-get install dataset-fashion-mnist` or pass --src DIR "
                        "holding the four Fashion-MNIST IDX files")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path} ({exc}): the file is corrupt; reinstall dataset-fashion-mnist") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != _IDX_UBYTE:
        raise DataError(f"{path} is not an IDX file of unsigned bytes (bad magic number)")
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} = {int(np.prod(dims))} bytes, found {body.size} (truncated?)")
    return body.reshape(dims)


def load_split(src: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    images_file, labels_file = FILES[split]
    images, labels = read_idx(src / images_file), read_idx(src / labels_file)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(f"{src}: {split} images {images.shape} and labels {labels.shape} do not match")
    if labels.max(initial=0) >= len(CLASSES):
        raise DataError(f"{src / labels_file}: label {labels.max()} outside the {len(CLASSES)} classes")
    return images, labels


def build(src: Path = DEFAULT_SRC, out: Path = Path("shards/fashion_mnist"), max_count: int = 10_000,
          max_size: float = 256e6, progress: bool = True) -> dict[str, Manifest]:
    """Write ``out/train`` and ``out/test``; return their manifests."""
    src, out = Path(src), Path(out)
    data = {split: load_split(src, split) for split in FILES}  # fail on a missing file before writing
    records = {split: (indexed_records(images, labels), len(images)) for split, (images, labels) in data.items()}
    h, w = data["train"][0].shape[1:]
    return write_image_splits(out, records, progress=progress, dataset="fashion_mnist", classes=list(CLASSES),
                              info={"image_size": [int(h), int(w)], "channels": 1}, source=str(src.resolve()),
                              recipe="fashion_mnist", recipe_version=RECIPE_VERSION, max_count=max_count,
                              max_size=max_size)


def main(argv: list[str] | None = None) -> int:
    """``python data/fashion_mnist.py``: the options of :func:`patchplace.pipelines.datasets.fashion_mnist_parser`."""
    return run(parse("fashion_mnist", argv))


def run(args: argparse.Namespace) -> int:
    return run_cli(lambda: build(args.src, args.out, args.max_count, args.max_size))

if __name__ == "__main__":
    sys.exit(main())
