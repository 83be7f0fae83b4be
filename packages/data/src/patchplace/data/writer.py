"""Write a split as WebDataset tar shards + ``manifest.json``, atomically.

Shards are written into a temporary sibling directory and renamed into place only when the split and its
manifest are complete, so an interrupted recipe never leaves a shard or manifest that looks finished.
Tar members get a fixed mtime, so the same input gives byte-identical shards (stable sha256).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds

from .atomic import atomic_dir
from .codecs import decode_image_bytes, decode_wav, encode_png, encode_wav, encoded_size
from .errors import DataError
from .manifest import Manifest, ShardInfo, sha256_file
from .remote import refuse_url

RECORD_MTIME = 0.0  # reproducible tars


class ChannelStats:
    """Running per-channel mean / std of uint8 images in [0, 1] units (float64 sums)."""

    def __init__(self, channels: int) -> None:
        self.channels = channels
        self.n = 0
        self.sum = np.zeros(channels)
        self.sumsq = np.zeros(channels)

    def update(self, image: np.ndarray) -> None:
        x = np.asarray(image, dtype=np.float64).reshape(-1, self.channels) / 255.0
        self.n += x.shape[0]
        self.sum += x.sum(0)
        self.sumsq += (x * x).sum(0)

    def result(self, computed_on: str) -> dict[str, Any]:
        if self.n == 0:
            raise DataError("no pixels seen: cannot compute normalization statistics")
        mean = self.sum / self.n
        std = np.sqrt(np.maximum(self.sumsq / self.n - mean**2, 1e-12))
        return {"mean": [round(float(m), 6) for m in mean], "std": [round(float(s), 6) for s in std],
                "computed_on": computed_on}


class SplitWriter:
    """Write one split of a dataset to ``<out_dir>/<split>/``.

    >>> with SplitWriter("shards/fmnist", "train", dataset="fashion_mnist", modality="image",
    ...                  classes=names, info={"image_size": [28, 28], "channels": 1},
    ...                  source=src, recipe="fashion_mnist", recipe_version=1) as w:
    ...     for i, (img, y) in enumerate(samples):
    ...         w.add_image(f"{i:08d}", y, img)
    >>> w.manifest.num_samples

    ``input_ext`` names the tar member of the input (default ``png`` for images, ``wav`` for audio).
    Images: normalization statistics are accumulated from the written pixels unless ``normalization`` is
    given (pass the train split's statistics when writing validation/test splits).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        split: str,
        *,
        dataset: str,
        modality: str,
        classes: list[str],
        info: dict[str, Any],
        source: str,
        recipe: str,
        recipe_version: int,
        normalization: dict[str, Any] | None = None,
        max_count: int = 10_000,
        max_size: float = 256e6,
        input_ext: str | None = None,
    ) -> None:
        if max_count < 1 or max_size <= 0:
            raise DataError(f"max_count must be >= 1 and max_size > 0, got {max_count}, {max_size}")
        refuse_url(out_dir)  # s3://... is no directory to write in (Path() would make it a local "s3:/...")
        self.final_dir = Path(out_dir) / split
        self.split, self.dataset, self.modality = split, dataset, modality
        self.classes, self.info = list(classes), dict(info)
        self.source, self.recipe, self.recipe_version = source, recipe, recipe_version
        self.normalization = normalization
        # Member extension of the input: png / wav by default; "img" for original files of mixed formats
        # (JPEG, PNG), which the decoder recognizes by content.
        self.fields = {"input": input_ext or ("png" if modality == "image" else "wav"), "label": "cls"}
        self.stats = (ChannelStats(int(info.get("channels", 1)))
                      if modality == "image" and normalization is None else None)
        self.max_count, self.max_size = max_count, max_size
        self._keys: set[str] = set()
        self._class_counts = [0] * len(self.classes)
        self._shards: list[tuple[str, int]] = []
        self._dir_ctx = None
        self._writer: wds.ShardWriter | None = None
        self.manifest: Manifest | None = None

    # ------------------------------------------------------------------ context management
    def __enter__(self) -> SplitWriter:
        self._dir_ctx = atomic_dir(self.final_dir)
        self._tmp = self._dir_ctx.__enter__()
        self._writer = wds.ShardWriter(
            str(self._tmp / f"{self.split}-%06d.tar"), maxcount=self.max_count, maxsize=self.max_size,
            post=self._shard_done, verbose=0, encoder=False, mtime=RECORD_MTIME,
        )
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._dir_ctx is not None
        if exc_type is None:
            try:
                self._finish()
            except BaseException as err:
                self._dir_ctx.__exit__(type(err), err, err.__traceback__)
                raise
        else:
            self._writer.close()
        self._dir_ctx.__exit__(exc_type, exc, tb)

    def _shard_done(self, fname: str) -> None:
        self._shards.append((fname, self._writer.count))

    # ------------------------------------------------------------------ writing samples
    def write(self, key: str, label: int, payload: bytes) -> None:
        """Write one sample: ``payload`` is the encoded input (png / jpeg / wav bytes), ``label`` a class index.

        Checked as :meth:`add_image` / :meth:`add_audio` check theirs: an image must decode to the split's
        ``channels`` (a gray file in a 3-channel split is expanded, a colour file in a 1-channel split refused) and
        ``image_size``, and counts toward the split's normalization statistics; a WAV must be at its
        ``sample_rate``."""
        self._open()
        where = f"{key} ({self.dataset}/{self.split})"
        if self.modality == "image":
            decoded = decode_image_bytes(payload, int(self.info.get("channels", 1)), key=where)
            image = decoded.permute(1, 2, 0).numpy()
            image = image[:, :, 0] if image.shape[2] == 1 else image
            self._check_image(key, image, None)
            if self.stats is not None:
                self.stats.update(image)
        else:
            rate = int(self.info["sample_rate"])
            found = decode_wav(payload, key=f"sample {where}")[1]
            if found != rate:
                raise DataError(f"sample {where}: a {found} Hz WAV, the split declares sample_rate {rate}: resample "
                                "it before writing it (add_audio does), or declare what the split holds")
        self._write(key, label, payload)

    def _open(self) -> None:
        if self._writer is None:
            raise DataError("SplitWriter must be used as a context manager (`with SplitWriter(...) as w:`)")

    def _write(self, key: str, label: int, payload: bytes) -> None:
        """Write one checked sample (its key and label are checked here)."""
        self._open()
        if not key or "." in key or "/" in key:
            raise DataError(f"sample key {key!r} must be non-empty and contain no '.' or '/'")
        if key in self._keys:
            raise DataError(f"duplicate sample key {key!r} in {self.dataset}/{self.split}")
        if not 0 <= int(label) < len(self.classes):
            raise DataError(f"sample {key}: label {label} is outside the {len(self.classes)} classes "
                            f"of {self.dataset} (0..{len(self.classes) - 1})")
        self._keys.add(key)
        self._class_counts[int(label)] += 1
        self._writer.write({"__key__": key, self.fields["input"]: payload, "cls": str(int(label)).encode()})

    def add_image(self, key: str, label: int, image: np.ndarray, encoded: bytes | None = None) -> None:
        """Write a uint8 image (HxW or HxWxC); ``encoded`` keeps the original file bytes (e.g. JPEG) instead.

        The image must have the split's ``info`` ``channels`` and, when ``info`` gives one, its ``image_size``
        [H, W] (as must ``encoded``'s header): readers and transforms rely on it, nothing downstream resizes."""
        self._check_image(key, image, encoded)
        if self.stats is not None:
            self.stats.update(image)
        self._write(key, label, encoded if encoded is not None else encode_png(image))

    def _check_image(self, key: str, image: np.ndarray, encoded: bytes | None) -> None:
        """A DataError unless ``image`` (and ``encoded``'s header) has the size and channels ``info`` declares."""
        channels, declared = int(self.info.get("channels", 1)), self.info.get("image_size")
        if image.ndim not in (2, 3):
            raise DataError(f"sample {key}: an image is HxW or HxWxC, got shape {image.shape}")
        got = 1 if image.ndim == 2 else image.shape[2]
        size = tuple(image.shape[:2])
        coded = encoded_size(encoded, key) if encoded is not None else size
        if got != channels or coded != size or (declared and size != tuple(declared)):
            found = f"{size[0]}x{size[1]}" + (f" (its encoded bytes {coded[0]}x{coded[1]})" if coded != size else "")
            want = f" of {declared[0]}x{declared[1]}" if declared else ""
            raise DataError(f"sample {key}: a {found} image with {got} channel(s), the split declares {channels} "
                            f"channel(s){want} ({self.dataset}/{self.split} info): resize / convert it before writing "
                            "it, or declare what the split holds")

    def add_audio(self, key: str, label: int, wave: np.ndarray) -> None:
        """Write a mono float32 waveform at the split's ``sample_rate`` as 16-bit PCM WAV."""
        try:
            data = encode_wav(wave, int(self.info["sample_rate"]))
        except DataError as exc:
            raise DataError(f"{self.dataset}/{self.split} sample {key}: {exc}") from None
        self._write(key, label, data)

    # ------------------------------------------------------------------ finishing
    def _finish(self) -> None:
        self._writer.close()
        if not self._keys:
            raise DataError(f"no samples were written for {self.dataset}/{self.split}: check the source data")
        shards = []
        for fname, count in self._shards:
            path = Path(fname)
            if count == 0:  # ShardWriter opens a file before knowing a sample will follow
                path.unlink()
                continue
            shards.append(ShardInfo(name=path.name, count=count, sha256=sha256_file(path),
                                    bytes=path.stat().st_size))
        normalization = self.normalization
        if normalization is None and self.stats is not None:
            normalization = self.stats.result(computed_on=self.split)
        self.manifest = Manifest(
            dataset=self.dataset, split=self.split, modality=self.modality, classes=self.classes,
            num_samples=len(self._keys), shards=shards, fields=self.fields, info=self.info,
            source=self.source, recipe=self.recipe, recipe_version=self.recipe_version,
            normalization=normalization, class_counts=self._class_counts,
        )
        self.manifest.save(self._tmp / "manifest.json")
        self.manifest.path = self.final_dir / "manifest.json"
