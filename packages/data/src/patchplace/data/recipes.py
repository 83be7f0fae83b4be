"""Shared pieces of the ``data/`` recipes: common CLI options, writing image splits, error reporting."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from .errors import DataError
from .manifest import Manifest
from .writer import SplitWriter

# (key, label, uint8 image HxW[xC], original encoded bytes or None to store PNG)
ImageRecord = tuple[str, int, np.ndarray, bytes | None]


def indexed_records(images: np.ndarray, labels: np.ndarray) -> Iterator[ImageRecord]:
    """Records keyed by position (``00000``, ``00001``, ...) for datasets stored as arrays."""
    for i in range(len(images)):
        yield f"{i:05d}", int(labels[i]), images[i], None


def write_image_splits(
    out: Path,
    splits: Mapping[str, tuple[Iterable[ImageRecord], int]],
    *,
    progress: bool = True,
    **writer_kwargs: Any,
) -> dict[str, Manifest]:
    """Write each ``split -> (records, count)`` in order; the first split (train) supplies the normalization
    statistics of all of them."""
    manifests: dict[str, Manifest] = {}
    normalization = writer_kwargs.pop("normalization", None)
    for split, (records, total) in splits.items():
        with SplitWriter(out, split, modality="image", normalization=normalization, **writer_kwargs) as writer:
            for key, label, image, encoded in tqdm(records, total=total, desc=f"{writer.dataset}/{split}",
                                                   disable=not progress):
                writer.add_image(key, label, image, encoded)
        manifests[split] = writer.manifest
        normalization = normalization or {**writer.manifest.normalization, "computed_on": split}
    return manifests


def run_cli(build: Callable[[], Mapping[str, Manifest]]) -> int:
    """Run a recipe, print its manifests; a DataError becomes one line on stderr and exit code 2."""
    try:
        manifests = build()
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for manifest in manifests.values():
        print(manifest.summary())
    return 0
