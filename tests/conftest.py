"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from accelerate.state import AcceleratorState, GradientState

from patchplace.data import SplitWriter

# The files that take longest (measured: `make test` with --durations=0), first: xdist hands whole files to the
# two workers in collection order (`make test` passes --no-loadscope-reorder, which would otherwise order them by
# their number of tests), so the long ones start at once and the short ones fill in until both workers end together.
LONGEST_FIRST = ("test_scale_rehearsal.py", "test_ddp.py", "test_faults.py", "test_install.py", "test_study_v5.py",
                 "test_study.py", "test_streamed_probes.py", "test_benchmark.py", "test_pipelines.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    missing = [name for name in LONGEST_FIRST if not Path(__file__).with_name(name).exists()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that are not in tests/: {missing}"
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps one state per process and refuses an Accelerator with another mixed precision once it is
    set: each test starts from none (accelerate's own test idiom, ``AccelerateTestCase.tearDown``), so tests that
    run pipelines in-process may each ask for their own ``run.mixed_precision``."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Fashion-MNIST-shaped image shards (28 px gray, 3 classes) and 1 s audio shards (12 classes + noise)."""
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    for split, n in (("train", 64), ("test", 32)):
        with SplitWriter(root / "img", split, dataset="toy", modality="image", classes=["a", "b", "c"],
                         info={"image_size": [28, 28], "channels": 1}, source="test", recipe="test",
                         recipe_version=1, max_count=16) as w:
            for i in range(n):
                w.add_image(f"{i:04d}", i % 3, rng.integers(0, 256, (28, 28), dtype=np.uint8))
    classes = [f"k{i}" for i in range(12)]
    for split, n in (("train", 16), ("validation", 8), ("test", 8)):
        with SplitWriter(root / "audio", split, dataset="kws", modality="audio", classes=classes,
                         info={"sample_rate": 16000, "clip_samples": 16000}, source="test", recipe="test",
                         recipe_version=1) as w:
            for i in range(n):
                w.add_audio(f"{i:04d}", i % 12, (0.1 * rng.standard_normal(16000)).astype(np.float32))
    with SplitWriter(root / "audio", "background_noise", dataset="kws", modality="audio",
                     classes=["_background_noise_"], info={"sample_rate": 16000, "clip_samples": None},
                     source="test", recipe="test", recipe_version=1) as w:
        w.add_audio("noise", 0, (0.1 * rng.standard_normal(32000)).astype(np.float32))
    return root
