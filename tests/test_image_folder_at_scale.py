"""The image-folder recipe at scale, on toy layouts: class-mixed shards (--seed), byte-identical output for any
--workers, and the ILSVRC validation layout (a flat folder + --val-labels)."""

from __future__ import annotations

import hashlib
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from patchplace.data import DataError, Manifest, ShardDataset, SplitWriter
from patchplace.pipelines.datasets import image_folder

CLASSES = [f"n{i:08d}" for i in range(10)]
CHI2_DF9_P001 = 27.877  # chi-square quantile, 9 degrees of freedom, p = 0.001


def write_folder(root: Path, per_class: dict[str, int], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for split, n in per_class.items():
        for wnid in CLASSES:
            (root / split / wnid).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                fmt = ("png", "JPEG")[i % 2]
                Image.fromarray(pixels).save(root / split / wnid / f"{wnid}_{i}.{fmt}")


def shard_labels(manifest: Manifest) -> list[list[int]]:
    out = []
    for shard in manifest.shards:
        with tarfile.open(manifest.directory / shard.name) as tar:
            out.append([int(tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".cls")])
    return out


def chi_square(labels: list[int], proportions: np.ndarray) -> float:
    observed = np.bincount(labels, minlength=len(proportions))
    expected = len(labels) * proportions
    return float(((observed - expected) ** 2 / expected).sum())


def streamed_batch(split_dir: Path, n: int) -> list[int]:
    dataset = ShardDataset(split_dir, decode=False, shuffle_buffer=100, seed=1)
    labels = []
    for sample in dataset:
        labels.append(int(sample["cls"]))
        if len(labels) == n:
            return labels
    raise AssertionError("split too small")


def tree_sha256(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("toy") / "imagenet"
    write_folder(root, {"train": 60, "val": 6})
    return root


def test_every_shard_holds_every_class_and_a_streamed_batch_matches_the_split(toy, tmp_path):
    manifests = image_folder.build(toy, tmp_path / "out", max_count=100, progress=False)
    train = manifests["train"]
    assert len(train.shards) == 6 and train.class_counts == [60] * 10
    assert "seed 0" in train.source and train.recipe_version == image_folder.RECIPE_VERSION
    for labels in shard_labels(train):
        assert sorted(set(labels)) == list(range(10)), f"a shard misses a class: {Counter(labels)}"
    proportions = np.asarray(train.class_counts) / train.num_samples
    assert chi_square(streamed_batch(tmp_path / "out" / "train", 128), proportions) < CHI2_DF9_P001

    # The defect this fixes: shards written in class order hold 2-3 classes; a streamed batch, a few.
    files = image_folder.list_split(toy / "train", None)[1]
    with SplitWriter(tmp_path / "ordered", "train", dataset="toy", modality="image", classes=CLASSES,
                     info={"image_size": [8, 8], "channels": 3}, source="t", recipe="t", recipe_version=1,
                     normalization=train.normalization, max_count=100, input_ext="img") as w:
        for record in image_folder.records(files, toy / "train"):
            w.add_image(*record)
    assert max(len(set(labels)) for labels in shard_labels(w.manifest)) <= 3
    assert chi_square(streamed_batch(tmp_path / "ordered" / "train", 128), proportions) > 5 * CHI2_DF9_P001


def test_the_seed_changes_the_order_only(toy, tmp_path):
    a = image_folder.build(toy, tmp_path / "a", splits=("train",), max_count=100, progress=False)["train"]
    b = image_folder.build(toy, tmp_path / "b", splits=("train",), max_count=100, progress=False, seed=1)["train"]
    assert "seed 1" in b.source and a.class_counts == b.class_counts and a.normalization == b.normalization
    assert [s.sha256 for s in a.shards] != [s.sha256 for s in b.shards]
    keys = [{s["__key__"] for s in ShardDataset(tmp_path / d / "train", decode=False)} for d in ("a", "b")]
    assert keys[0] == keys[1] and len(keys[0]) == 600


@pytest.mark.parametrize("max_size", [256e6, 3000.0])  # count cuts; byte cuts
def test_workers_write_byte_identical_shards_and_manifests(toy, tmp_path, max_size):
    one = image_folder.build(toy, tmp_path / "w1", max_count=70, max_size=max_size, progress=False, workers=1)
    two = image_folder.build(toy, tmp_path / "w2", max_count=70, max_size=max_size, progress=False, workers=2)
    files = tree_sha256(tmp_path / "w1")
    assert files == tree_sha256(tmp_path / "w2") and len(files) > 6
    assert one["train"].fingerprint() == two["train"].fingerprint()
    assert len(one["train"].shards) == (9 if max_size > 1e6 else len(one["train"].shards)) > 1
    # The same order through one SplitWriter (webdataset's ShardWriter cuts) gives the same shards.
    files = image_folder.shuffled(image_folder.list_split(toy / "train", None)[1], 0, 0)
    with SplitWriter(tmp_path / "seq", "train", dataset="imagenet", modality="image", classes=CLASSES,
                     info={"image_size": [8, 8], "channels": 3}, source="t", recipe="t", recipe_version=1,
                     normalization=one["train"].normalization, max_count=70, max_size=max_size,
                     input_ext="img") as w:
        for record in image_folder.records(files, toy / "train"):
            w.add_image(*record)
    assert w.manifest.shards == one["train"].shards


# ------------------------------------------------------------------------------------------ ILSVRC val layout
@pytest.fixture
def ilsvrc(tmp_path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "ilsvrc"
    write_folder(root, {"train": 3})
    rng = np.random.default_rng(5)
    (root / "val").mkdir()
    truth = {}
    for i in range(1, 13):
        name = f"ILSVRC2012_val_{i:08d}"
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / "val" / f"{name}.JPEG")
        truth[name] = CLASSES[(i * 7) % 10]
    return root, truth


def write_csv(path: Path, truth: dict[str, str]) -> Path:
    lines = ["ImageId,PredictionString"] + [f"{k},{w} 1 2 30 40 {w} 5 6 7 8 " for k, w in truth.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("form", ["csv", "txt"])
def test_flat_ilsvrc_val_folder_with_a_label_file(ilsvrc, tmp_path, form):
    root, truth = ilsvrc
    if form == "csv":
        labels = write_csv(tmp_path / "LOC_val_solution.csv", truth)
    else:
        labels = tmp_path / "val.txt"
        labels.write_text("".join(f"{k}.JPEG {w}\n" for k, w in truth.items()))
    val = image_folder.build(root, tmp_path / "out", progress=False, val_labels=labels, workers=2)["val"]
    assert val.classes == CLASSES and val.num_samples == 12 and "val labels from" in val.source
    got = {s["__key__"]: int(s["cls"]) for s in ShardDataset(tmp_path / "out" / "val", decode=False)}
    assert got == {f"{k}_JPEG": CLASSES.index(w) for k, w in truth.items()}


def test_ilsvrc_label_errors_are_one_line(ilsvrc, tmp_path, capsys):
    root, truth = ilsvrc
    out = str(tmp_path / "out")
    with pytest.raises(DataError, match=r"has no class sub-folders.*needs --val-labels FILE"):
        image_folder.build(root, out, progress=False)
    with pytest.raises(DataError, match=r"missing --val-labels file .*nope.csv"):
        image_folder.build(root, out, progress=False, val_labels=tmp_path / "nope.csv")
    bad = dict(truth, ILSVRC2012_val_00000003="n99999999")
    with pytest.raises(DataError, match=r"line 4: ILSVRC2012_val_00000003.JPEG is labelled 'n99999999', not a "
                                        r"class \(folder\) of the first split"):
        image_folder.build(root, out, progress=False, val_labels=write_csv(tmp_path / "a.csv", bad))
    short = {k: w for k, w in truth.items() if k != "ILSVRC2012_val_00000005"}
    with pytest.raises(DataError, match=r"1 image\(s\) of .*val have no label in .*b.csv, e.g. "
                                        r"ILSVRC2012_val_00000005.JPEG"):
        image_folder.build(root, out, progress=False, val_labels=write_csv(tmp_path / "b.csv", short))
    extra = dict(truth, ILSVRC2012_val_00000099=CLASSES[0])
    with pytest.raises(DataError, match=r"labels 1 image\(s\) not in .*ILSVRC2012_val_00000099"):
        image_folder.build(root, out, progress=False, val_labels=write_csv(tmp_path / "c.csv", extra))
    (tmp_path / "gt.txt").write_text("490\n361\n")
    with pytest.raises(DataError, match=r"line 1: a bare class index \(the devkit's"):
        image_folder.build(root, out, progress=False, val_labels=tmp_path / "gt.txt")
    assert not Path(out).exists(), "a failed recipe leaves no shards"
    for labels in (tmp_path / "nope.csv", tmp_path / "a.csv", tmp_path / "b.csv"):
        assert image_folder.main(["--src", str(root), "--out", out, "--val-labels", str(labels)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
