"""Files are not trusted blindly: images must have their manifest's size (written and read), and every shard's bytes
must match the size and sha256 its manifest records before a reader uses any of its samples (in memory, streaming,
``pipe:`` URLs); ``skip_corrupt`` skips and counts a shard that does not."""

from __future__ import annotations

import dataclasses
import io
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from patchplace.data import (
    DataError,
    ImageTransform,
    InMemorySplit,
    Manifest,
    ShardDataset,
    ShardInfo,
    SplitWriter,
    encode_png,
    encode_wav,
)
from patchplace.data.batched import BatchedImageAugment
from patchplace.data.manifest import sha256_file
from patchplace.data.remote import RemoteError


def writer_28px(out: Path) -> SplitWriter:
    """A Fashion-MNIST-like split: 28 x 28 gray, 3 classes."""
    return SplitWriter(out, "train", dataset="toy", modality="image", classes=["a", "b", "c"],
                       info={"image_size": [28, 28], "channels": 1}, source="test", recipe="toy", recipe_version=1,
                       max_count=4)


def write_28px_split(out: Path, n: int = 10) -> Path:
    rng = np.random.default_rng(0)
    with writer_28px(out) as writer:
        for i in range(n):
            writer.add_image(f"{i:05d}", i % 3, rng.integers(0, 256, (28, 28), dtype=np.uint8))
    return out / "train"


def rewrite_member(shard: Path, name: str, data: bytes) -> None:
    """Replace one member of a tar shard (the tar stays valid, the members keep their order)."""
    with tarfile.open(shard) as tar:
        members = [(info, data if info.name == name else tar.extractfile(info).read()) for info in tar.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, payload in members:
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def reseal(split_dir: Path) -> None:
    """Record the shards' current sizes and hashes in the manifest (as a recipe that wrote them so would)."""
    m = Manifest.load(split_dir)
    m.shards = [resealed(s, split_dir / s.name) for s in m.shards]
    m.save(split_dir)


def resealed(shard: ShardInfo, file: Path) -> ShardInfo:
    return dataclasses.replace(shard, sha256=sha256_file(file), bytes=file.stat().st_size)


def flip_label(shard: Path, key: str, label: int) -> None:
    """Overwrite the one byte of ``key``'s .cls member in place: another valid class, the tar otherwise intact."""
    with tarfile.open(shard) as tar:
        offset = tar.getmember(f"{key}.cls").offset_data
    data = bytearray(shard.read_bytes())
    assert data[offset:offset + 2] != str(label).encode() and data[offset + 1] == 0  # a one-digit class
    data[offset] = ord(str(label))
    shard.write_bytes(bytes(data))


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------- image sizes
def test_the_writer_refuses_an_image_of_another_size_than_its_split_declares(tmp_path):
    image = np.zeros((64, 64), np.uint8)
    with pytest.raises(DataError) as exc, writer_28px(tmp_path) as writer:
        writer.add_image("00000", 0, np.zeros((28, 28), np.uint8))
        writer.add_image("00001", 1, image)
    assert one_line(exc).startswith("sample 00001: a 64x64 image with 1 channel(s), the split declares 1 channel(s) "
                                    "of 28x28 (toy/train info)")
    assert not (tmp_path / "train").exists(), "nothing is left of a refused split"
    with pytest.raises(DataError, match=r"sample 00000: a 28x28 \(its encoded bytes 64x64\) image"), \
            writer_28px(tmp_path) as writer:  # original bytes kept (e.g. JPEG) must be what was checked
        writer.add_image("00000", 0, np.zeros((28, 28), np.uint8), encoded=encode_png(image))


def test_an_injected_64px_sample_is_refused_at_read_in_both_paths(tmp_path):
    split_dir = write_28px_split(tmp_path)
    shard = split_dir / "train-000001.tar"
    rewrite_member(shard, "00005.png", encode_png(np.zeros((64, 64), np.uint8)))
    # the manifest's size / sha256 no longer match: refused before any sample is decoded
    with pytest.raises(DataError, match=rf"^corrupt shard {shard}: sha256 \w+ differs from the manifest's"):
        list(ShardDataset(split_dir))  # (tars are padded to 10 KiB records: the same size)
    with pytest.raises(DataError, match=rf"^corrupt shard {shard}: "):
        InMemorySplit.load(split_dir)
    # shards and manifest agree byte-wise (a recipe wrote them so): the image's size is still refused, not cropped
    reseal(split_dir)
    expected = (f"sample 00005 in {shard}: a 64x64 image, but the manifest of toy/train declares image_size 28x28: "
                "the shard does not match its manifest; rebuild the split with its data/ recipe")
    for read in (lambda: list(ShardDataset(split_dir)), lambda: InMemorySplit.load(split_dir),
                 lambda: InMemorySplit.load(split_dir, num_workers=1)):
        with pytest.raises(DataError) as exc:
            read()
        assert one_line(exc) == expected


def test_transforms_refuse_images_of_another_size_than_the_manifest(tmp_path):
    manifest = Manifest.load(write_28px_split(tmp_path, n=4))
    big = torch.zeros(1, 64, 64, dtype=torch.uint8)
    for pad_to in (None, 32):  # pad_to / img_size remain configured operations on 28 px images
        with pytest.raises(DataError, match="a 64x64 image, but the manifest of toy/train declares image_size 28x28"):
            ImageTransform(manifest, False, None if pad_to is None else _config(pad_to))(big)
        with pytest.raises(DataError, match="a 64x64 image, but the manifest of toy/train declares image_size 28x28"):
            BatchedImageAugment(manifest, True, _config(pad_to))(big[None], torch.arange(1), 0, 0)
    assert ImageTransform(manifest, True, _config(32))(torch.zeros(1, 28, 28, dtype=torch.uint8)).shape == (1, 32, 32)


def _config(pad_to: int | None):
    from patchplace.data import ImageTransformConfig

    return ImageTransformConfig(pad_to=pad_to)


def test_a_wav_at_another_rate_than_the_manifest_is_refused_while_clip_lengths_may_vary(tmp_path):
    with SplitWriter(tmp_path, "train", dataset="kws", modality="audio", classes=["a", "b"],
                     info={"sample_rate": 16000, "clip_samples": 16000}, source="test", recipe="toy",
                     recipe_version=1) as writer:
        for i, n in enumerate((8000, 16000, 20000)):  # clips are stored unpadded; transforms fix their length
            writer.add_audio(f"{i:03d}", i % 2, np.zeros(n, np.float32))
    split_dir = tmp_path / "train"
    assert [len(x) for x, _ in ShardDataset(split_dir)] == [8000, 16000, 20000]
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(8000, np.float32), 8000, format="WAV", subtype="PCM_16")
    rewrite_member(split_dir / "train-000000.tar", "001.wav", buf.getvalue())
    assert encode_wav(np.zeros(8000, np.float32), 8000) == buf.getvalue()
    reseal(split_dir)
    with pytest.raises(DataError, match=r"sample 001 in .*train-000000.tar: a 8000 Hz WAV, but the manifest of "
                                        "kws/train declares sample_rate 16000"):
        list(ShardDataset(split_dir))


# ---------------------------------------------------------------------------------------------- shard checksums
def flipped_split(tmp_path: Path) -> tuple[Path, Path]:
    """10 samples in shards of 4, 4, 2; sample 00005 (class 2) relabelled 0 in place in the second shard."""
    split_dir = write_28px_split(tmp_path)
    shard = split_dir / "train-000001.tar"
    size = shard.stat().st_size
    flip_label(shard, "00005", 0)
    with tarfile.open(shard) as tar:  # a valid tar holding another valid class
        assert tar.extractfile("00005.cls").read() == b"0" and shard.stat().st_size == size
    return split_dir, shard


def checksum_message(split_dir: Path, shard: Path) -> str:
    entry = Manifest.load(split_dir).shards[1]
    return (f"corrupt shard {shard}: sha256 {sha256_file(shard)} differs from the manifest's {entry.sha256} for "
            f"{shard.name} (its bytes changed after the split was written); rebuild the split with its data/ recipe, "
            f"check all shards with `python -m patchplace.data verify {split_dir}`, or skip bad shards (counted) with "
            "data.skip_corrupt=true (ShardDataset(skip_corrupt=True))")


@pytest.mark.parametrize("path", ["streaming", "memory", "memory-workers"])
def test_a_flipped_label_byte_is_refused_at_read_with_one_line(tmp_path, path):
    split_dir, shard = flipped_split(tmp_path)
    read = {"streaming": lambda: list(ShardDataset(split_dir)),
            "memory": lambda: InMemorySplit.load(split_dir),
            "memory-workers": lambda: InMemorySplit.load(split_dir, num_workers=2)}[path]
    with pytest.raises(DataError) as exc:
        read()
    assert one_line(exc) == checksum_message(split_dir, shard)


def test_with_skip_corrupt_the_altered_shard_is_skipped_whole_and_counted(tmp_path):
    split_dir, shard = flipped_split(tmp_path)
    dataset = ShardDataset(split_dir, skip_corrupt=True, return_key=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys = [k for _, _, k in dataset]
    assert dataset.skipped == [str(shard)] and any(f"skipping corrupt shard {shard}: sha256" in str(w.message)
                                                   for w in caught)
    assert keys == ["00000", "00001", "00002", "00003", "00008", "00009"], "no sample of the shard was used"
    with pytest.warns(UserWarning, match=f"skipping corrupt shard {shard}: sha256"):
        split = InMemorySplit.load(split_dir, skip_corrupt=True)
    assert split.skipped == [str(shard)] and split.keys == keys


def test_url_overrides_are_verified_too(tmp_path, monkeypatch):
    from patchplace.data import integrity

    split_dir, shard = flipped_split(tmp_path)
    brace = str(split_dir / "train-{000000..000002}.tar")
    files = [f"file://{split_dir / s.name}" for s in Manifest.load(split_dir).shards]
    pipes = [f"pipe:cat {split_dir / s.name}" for s in Manifest.load(split_dir).shards]
    for urls, url in ((brace, str(shard)), (files, files[1]), (pipes, pipes[1])):
        with pytest.raises(DataError, match=rf"^corrupt shard {url}: sha256 \w+ differs from the manifest's"):
            list(ShardDataset(split_dir, urls=urls))
        with pytest.raises(DataError, match=rf"^corrupt shard {url}: sha256 \w+ differs from the manifest's"):
            InMemorySplit.load(split_dir, urls=urls)
    flip_label(shard, "00005", 2)  # repaired: streamed shards are spooled (here on disk) and read once
    monkeypatch.setattr(integrity, "SPOOL_IN_MEMORY", 100)
    expected = [(k, y) for _, y, k in ShardDataset(split_dir, return_key=True)]
    assert [(k, y) for _, y, k in ShardDataset(split_dir, urls=pipes, return_key=True)] == expected
    # a command that fails is named with its exit status: the command, not a corrupt shard
    with pytest.raises(RemoteError, match=r"^command `cat /nonexistent.tar` exited with status 1 \(cat: .*No such "):
        list(ShardDataset(split_dir, urls=[pipes[0], "pipe:cat /nonexistent.tar", pipes[2]]))


def test_verification_can_be_turned_off_and_then_trusts_the_bytes(tmp_path):
    split_dir, _ = flipped_split(tmp_path)
    labels = dict((k, y) for _, y, k in ShardDataset(split_dir, return_key=True, verify=False))
    assert labels["00005"] == 0
    assert InMemorySplit.load(split_dir, verify=False).labels[5] == 0
