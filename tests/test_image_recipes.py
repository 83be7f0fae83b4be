"""The image recipes on tiny inputs written here in the real on-disk formats, read back through the reader."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from patchplace.data import DataError, ShardDataset
from patchplace.pipelines.datasets import cifar, fashion_mnist, image_folder


def read_back(split_dir: Path) -> dict[str, tuple[np.ndarray, int]]:
    return {k: (x.numpy(), y) for x, y, k in ShardDataset(split_dir, return_key=True)}


# ------------------------------------------------------------------------------------------ Fashion-MNIST
def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def idx_dir(tmp_path):
    rng = np.random.default_rng(0)
    data = {"train": (rng.integers(0, 256, (30, 28, 28)), rng.integers(0, 10, 30)),
            "test": (rng.integers(0, 256, (12, 28, 28)), rng.integers(0, 10, 12))}
    for split, (images_file, labels_file) in fashion_mnist.FILES.items():
        write_idx(tmp_path / images_file, data[split][0])
        write_idx(tmp_path / labels_file, data[split][1])
    return tmp_path, data


def test_fashion_mnist_recipe_round_trips_idx_files(idx_dir, tmp_path):
    src, data = idx_dir
    manifests = fashion_mnist.build(src, tmp_path / "out", max_count=8, progress=False)
    assert manifests["train"].num_samples == 30 and len(manifests["train"].shards) == 4
    assert manifests["test"].normalization == manifests["train"].normalization
    assert manifests["test"].classes[0] == "T-shirt/top" and manifests["train"].info["channels"] == 1
    for split, (images, labels) in data.items():
        got = read_back(tmp_path / "out" / split)
        for i in range(len(images)):
            x, y = got[f"{i:05d}"]
            assert y == labels[i] and np.array_equal(x[0], images[i])


def test_fashion_mnist_errors_say_how_to_fix(idx_dir, tmp_path, capsys):
    src, _ = idx_dir
    with pytest.raises(DataError, match=r"missing .*train-images-idx3-ubyte.gz: run `apt-get install "
                                        r"dataset-fashion-mnist` or pass --src"):
        fashion_mnist.build(tmp_path / "empty", tmp_path / "out")
    images = src / fashion_mnist.FILES["train"][0]
    with gzip.open(images) as f:
        raw = f.read()
    with gzip.open(images, "wb") as f:
        f.write(raw[:-100])
    with pytest.raises(DataError, match="truncated"):
        fashion_mnist.build(src, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "a failed recipe must not leave shards behind"
    assert fashion_mnist.main(["--src", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.skipif(not fashion_mnist.DEFAULT_SRC.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_the_installed_fashion_mnist_files_parse():
    images, labels = fashion_mnist.load_split(fashion_mnist.DEFAULT_SRC, "test")
    assert images.shape == (10000, 28, 28) and np.bincount(labels).tolist() == [1000] * 10


# ------------------------------------------------------------------------------------------ CIFAR
def write_cifar10(root: Path, per_batch: int = 4) -> dict[str, tuple[np.ndarray, list[int]]]:
    rng = np.random.default_rng(1)
    root.mkdir()
    out = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        with open(root / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data}, f, protocol=2)
        out[name] = (data, labels)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"class{i}".encode() for i in range(10)], b"num_vis": 3072}, f, protocol=2)
    return out


def test_cifar10_recipe_keeps_the_rgb_plane_layout(tmp_path):
    batches = write_cifar10(tmp_path / "cifar-10-batches-py")
    manifests = cifar.build(tmp_path / "cifar-10-batches-py", tmp_path / "out", progress=False)
    assert manifests["train"].num_samples == 20 and manifests["test"].num_samples == 4
    assert manifests["train"].classes[3] == "class3" and manifests["train"].info["channels"] == 3
    got = read_back(tmp_path / "out" / "train")
    data, labels = batches["data_batch_2"]
    x, y = got["00005"]  # second sample of the second batch
    assert y == labels[1]
    assert np.array_equal(x[0].ravel(), data[1, :1024]) and np.array_equal(x[2].ravel(), data[1, 2048:])


def test_cifar100_coarse_labels(tmp_path):
    root = tmp_path / "cifar-100-python"
    root.mkdir()
    rng = np.random.default_rng(2)
    for name, n in (("train", 6), ("test", 3)):
        with open(root / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         b"fine_labels": list(range(n)), b"coarse_labels": [n - 1 - i for i in range(n)]}, f)
    with open(root / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"f{i}".encode() for i in range(100)],
                     b"coarse_label_names": [f"c{i}".encode() for i in range(20)]}, f)
    m = cifar.build(root, tmp_path / "out", labels="coarse", progress=False)["train"]
    assert m.dataset == "cifar100-coarse" and m.num_classes == 20
    assert [y for _, y in ShardDataset(tmp_path / "out" / "train")] == [5, 4, 3, 2, 1, 0]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar_reader_refuses_pickles_that_would_run_code(tmp_path):
    write_cifar10(tmp_path / "c")
    with open(tmp_path / "c" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": _Exploit()}, f)
    with pytest.raises(DataError, match=r"global .*system is not allowed"):
        cifar.build(tmp_path / "c", tmp_path / "out", progress=False)


# ------------------------------------------------------------------------------------------ class folders
def test_image_folder_recipe_keeps_jpeg_bytes_and_maps_classes(tmp_path):
    rng = np.random.default_rng(3)
    root = tmp_path / "pets"
    pixels = {}
    for split, n in (("train", 3), ("val", 1)):
        for cls in ("cat", "dog"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                image = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
                fmt = ("png", "jpg", "bmp")[i % 3]
                Image.fromarray(image).save(root / split / cls / f"img{i}.{fmt}")
                pixels[(split, cls, i, fmt)] = image
    manifests = image_folder.build(root, tmp_path / "out", progress=False)
    assert manifests["train"].classes == ["cat", "dog"] and manifests["val"].num_samples == 2
    assert manifests["train"].info == {"image_size": [10, 10], "channels": 3}
    raw = {s["__key__"]: s for s in ShardDataset(tmp_path / "out" / "train", decode=False)}
    assert raw["dog__img1_jpg"]["img"] == (root / "train/dog/img1.jpg").read_bytes(), "JPEG stored as is"
    got = read_back(tmp_path / "out" / "train")
    for cls_index, cls in enumerate(("cat", "dog")):
        for i, fmt in ((0, "png"), (2, "bmp")):  # lossless sources decode pixel-exact
            x, y = got[f"{cls}__img{i}_{fmt}"]
            assert y == cls_index and np.array_equal(x.transpose(1, 2, 0), pixels[("train", cls, i, fmt)])


def test_image_folder_rejects_unknown_classes_and_missing_splits(tmp_path):
    for split, cls in (("train", "cat"), ("val", "cow")):
        (tmp_path / "r" / split / cls).mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "r" / split / cls / "a.png")
    with pytest.raises(DataError, match=r"class folder\(s\) \['cow'\] are not classes of the first split"):
        image_folder.build(tmp_path / "r", tmp_path / "out", progress=False)
    with pytest.raises(DataError, match=r"missing split folder .*test"):
        image_folder.build(tmp_path / "r", tmp_path / "out", splits=("train", "test"), progress=False)
