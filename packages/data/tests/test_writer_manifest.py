"""SplitWriter + Manifest: what lands on disk, atomicity, and the errors a user sees."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from patchplace.data import DataError, Manifest, ShardDataset, SplitWriter, verify_split
from patchplace.data.atomic import atomic_file
from patchplace.data.manifest import sha256_file


def _writer(out: Path, **kw) -> SplitWriter:
    args = dict(dataset="toy", modality="image", classes=["a", "b"], info={"image_size": [4, 4], "channels": 1},
                source="test", recipe="toy", recipe_version=1)
    return SplitWriter(out, "train", **{**args, **kw})


def test_manifest_describes_the_shards_exactly(toy_split):
    split_dir, images = toy_split
    m = Manifest.load(split_dir)
    assert m.num_samples == 23 and [s.count for s in m.shards] == [5, 5, 5, 5, 3]
    assert m.class_counts == [8, 8, 7]
    for shard in m.shards:
        path = split_dir / shard.name
        assert sha256_file(path) == shard.sha256 and path.stat().st_size == shard.bytes
        with tarfile.open(path) as tar:
            assert len({n.split(".")[0] for n in tar.getnames()}) == shard.count
    pixels = np.stack(images).astype(np.float64) / 255
    assert m.normalization["mean"][0] == pytest.approx(pixels.mean(), abs=1e-6)
    assert m.normalization["std"][0] == pytest.approx(pixels.std(), abs=1e-6)
    assert verify_split(m) == []


def test_images_round_trip_pixel_exact_with_stable_keys(toy_split):
    split_dir, images = toy_split
    got = {key: (x, y) for x, y, key in ShardDataset(split_dir, return_key=True)}
    assert sorted(got) == [f"{i:05d}" for i in range(23)]
    for i, image in enumerate(images):
        x, y = got[f"{i:05d}"]
        assert y == i % 3 and np.array_equal(x[0].numpy(), image)


def test_same_input_gives_byte_identical_shards(tmp_path, make_toy_split):
    a, _ = make_toy_split(tmp_path / "a")
    b, _ = make_toy_split(tmp_path / "b")
    assert [s.sha256 for s in Manifest.load(a).shards] == [s.sha256 for s in Manifest.load(b).shards]
    assert Manifest.load(a).fingerprint() == Manifest.load(b).fingerprint()
    assert Manifest.load(a).fingerprint() != Manifest.load(make_toy_split(tmp_path / "c", seed=1)[0]).fingerprint()
    moved = Manifest.load(a)
    moved.source = "/elsewhere"
    assert moved.fingerprint() == Manifest.load(a).fingerprint(), "provenance must not change the fingerprint"


def test_interrupted_write_leaves_nothing_and_keeps_the_previous_split(tmp_path, make_toy_split):
    split_dir, _ = make_toy_split(tmp_path / "toy")
    before = Manifest.load(split_dir).to_dict()
    with pytest.raises(RuntimeError), _writer(tmp_path / "toy") as writer:
        writer.add_image("00000", 0, np.zeros((4, 4), np.uint8))
        raise RuntimeError("killed midway")
    assert Manifest.load(split_dir).to_dict() == before
    assert sorted(p.name for p in (tmp_path / "toy").iterdir()) == ["train"]
    with pytest.raises(RuntimeError), _writer(tmp_path / "fresh") as writer:
        writer.add_image("00000", 0, np.zeros((4, 4), np.uint8))
        raise RuntimeError("killed midway")
    assert list((tmp_path / "fresh").iterdir()) == []


@pytest.mark.parametrize(("key", "label", "image", "message"), [
    ("00000", 2, np.zeros((4, 4), np.uint8), "label 2 is outside the 2 classes"),
    ("00000", -1, np.zeros((4, 4), np.uint8), "label -1 is outside"),
    ("a.b", 0, np.zeros((4, 4), np.uint8), "contain no '.'"),
    ("00000", 0, np.zeros((4, 4, 3), np.uint8), "3 channel(s), the split declares 1"),
    ("00000", 0, np.zeros((4, 4), np.float32), "stored as uint8"),
])
def test_bad_samples_are_refused_with_the_reason(tmp_path, key, label, image, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")), \
            _writer(tmp_path) as writer:
        writer.add_image(key, label, image)
    assert not (tmp_path / "train").exists()


def test_duplicate_keys_and_empty_splits_are_errors(tmp_path):
    with pytest.raises(DataError, match="duplicate sample key '7'"), _writer(tmp_path) as writer:
        writer.add_image("7", 0, np.zeros((4, 4), np.uint8))
        writer.add_image("7", 1, np.zeros((4, 4), np.uint8))
    with pytest.raises(DataError, match="no samples were written"), _writer(tmp_path):
        pass
    assert not (tmp_path / "train").exists()


def test_manifest_errors_name_the_file_and_the_fix(tmp_path, toy_split):
    with pytest.raises(DataError, match=r"no manifest at .*nowhere.*python data/fashion_mnist.py"):
        Manifest.load(tmp_path / "nowhere")
    split_dir, _ = toy_split
    raw = json.loads((split_dir / "manifest.json").read_text())
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**raw, "colour": "red"}))
    with pytest.raises(DataError, match=r"broken.json: unknown field\(s\) \['colour'\]"):
        Manifest.load(broken)
    broken.write_text(json.dumps({**raw, "num_samples": 99}))
    with pytest.raises(DataError, match="shard counts sum to 23 but num_samples is 99"):
        Manifest.load(broken)
    broken.write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        Manifest.load(broken)


def test_verify_finds_truncated_and_altered_shards(toy_split):
    split_dir, _ = toy_split
    m = Manifest.load(split_dir)
    first, second = (split_dir / s.name for s in m.shards[:2])
    first.write_bytes(first.read_bytes()[:1000])
    data = bytearray(second.read_bytes())
    data[700] ^= 0xFF
    second.write_bytes(bytes(data))
    problems = verify_split(m)
    assert len(problems) == 2 and "truncated" in problems[0] and "sha256" in problems[1]


def test_cli_show_and_verify(toy_split, tmp_path, capsys):
    from patchplace.data.__main__ import main

    split_dir, _ = toy_split
    assert main(["verify", str(split_dir.parent)]) == 0
    assert "toy/train: 23 image samples in 5 shard(s)" in capsys.readouterr().out
    shard = split_dir / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:512])
    assert main(["verify", str(split_dir)]) == 1
    assert "train-000001.tar" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "missing")]) == 2
    assert "no manifest.json in" in capsys.readouterr().err


def test_atomic_file_replaces_on_success_and_leaves_nothing_on_error(tmp_path):
    final = tmp_path / "sub" / "images.npz"
    with atomic_file(final) as tmp:
        assert tmp.suffix == ".npz" and tmp.parent == final.parent and not final.exists()
        np.savez_compressed(tmp, a=np.arange(3))  # np.savez keeps a path that already ends in .npz
    assert np.load(final)["a"].tolist() == [0, 1, 2]
    with pytest.raises(RuntimeError), atomic_file(final) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("interrupted")
    assert np.load(final)["a"].tolist() == [0, 1, 2]  # the old file stays whole
    assert sorted(p.name for p in final.parent.iterdir()) == ["images.npz"]  # no temp file left behind
