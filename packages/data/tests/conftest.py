"""Small shard-writing helpers shared by the data package's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from patchplace.data import SplitWriter


def write_toy_split(out: Path, n: int = 23, classes: int = 3, max_count: int = 5, size: int = 8,
                    channels: int = 1, split: str = "train", seed: int = 0) -> tuple[Path, list[np.ndarray]]:
    """``n`` random uint8 images, label = i % classes, keys ``00000``..; returns (split dir, images)."""
    rng = np.random.default_rng(seed)
    shape = (size, size) if channels == 1 else (size, size, channels)
    images = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(n)]
    with SplitWriter(out, split, dataset="toy", modality="image", classes=[f"c{i}" for i in range(classes)],
                     info={"image_size": [size, size], "channels": channels}, source="test", recipe="toy",
                     recipe_version=1, max_count=max_count) as writer:
        for i, image in enumerate(images):
            writer.add_image(f"{i:05d}", i % classes, image)
    return out / split, images


@pytest.fixture
def make_toy_split():
    """The :func:`write_toy_split` factory (tests run in importlib mode, so conftest is not importable)."""
    return write_toy_split


@pytest.fixture
def toy_split(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    return write_toy_split(tmp_path / "toy")
