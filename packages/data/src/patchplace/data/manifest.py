"""``manifest.json``: what a split of shards holds, so readers can plan epochs and verify shards.

One manifest per split directory (``<out>/<split>/manifest.json``) next to its ``<split>-NNNNNN.tar`` shards; the
same directory served over HTTP or kept in an object store loads from its URL (``http://host/<split>``,
``s3://bucket/<dataset>/<split>``: :mod:`patchplace.data.remote`, :mod:`patchplace.data.stores`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .atomic import write_json_atomic
from .errors import DataError
from .remote import SCHEMES, Network, fetch, is_remote, url_scheme

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MODALITIES = ("image", "audio")
_CONTENT_FIELDS = ("dataset", "split", "modality", "classes", "num_samples", "shards", "fields", "info",
                   "normalization")
_PLACE_FIELDS = ("path", "url", "network")  # where this copy was loaded from and how: not part of the file


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard: file name relative to the manifest, sample count, sha256 and size in bytes."""

    name: str
    count: int
    sha256: str
    bytes: int


@dataclass
class Manifest:
    """Metadata of one split.

    ``fields`` maps roles to tar member extensions (``{"input": "png", "label": "cls"}``); ``info`` holds
    modality facts (images: ``image_size`` [H, W] and ``channels``; audio: ``sample_rate`` and ``clip_samples``);
    ``normalization`` holds per-channel ``mean`` / ``std`` in [0, 1] units, computed on the train split.
    ``path`` / ``url``: the ``manifest.json`` it was loaded from (a file, or a URL); ``network``: the timeout and
    retries its shards are fetched by URL with.
    """

    dataset: str
    split: str
    modality: str
    classes: list[str]
    num_samples: int
    shards: list[ShardInfo]
    fields: dict[str, str]
    info: dict[str, Any]
    source: str
    recipe: str
    recipe_version: int
    normalization: dict[str, Any] | None = None
    class_counts: list[int] | None = None
    format_version: int = FORMAT_VERSION
    path: Path | None = field(default=None, compare=False, repr=False)
    url: str | None = field(default=None, compare=False, repr=False)
    network: Network | None = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------------ loading / saving
    @classmethod
    def load(cls, path: str | os.PathLike, network: Network | None = None) -> Manifest:
        """Load ``path`` (a split directory or its ``manifest.json``, on disk or a URL: ``http(s)://``, ``s3://``,
        ``gs://``, ``hf://``, ...), validating every field. ``network``: the timeout and retries of fetching it and
        its shards by URL."""
        if is_remote(path):
            return cls._load_url(str(path), network or Network())
        path = Path(path)
        file = path / MANIFEST_NAME if path.is_dir() else path
        if not file.is_file():
            hint = dataset_dir_hint(path)
            if hint:
                raise DataError(hint)
            raise DataError(
                f"no manifest at {file}: build the split with a data/ recipe "
                f"(e.g. `python data/fashion_mnist.py --out {path.parent if path.is_dir() else path.parent.parent}`)"
            )
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{file} is not valid JSON ({exc}); rebuild the split with its data/ recipe") from exc
        manifest = cls.from_dict(raw, path=file)
        manifest.network = network
        return manifest

    @classmethod
    def _load_url(cls, url: str, network: Network) -> Manifest:
        """The manifest served at ``url`` (a split directory's URL or its ``manifest.json``'s)."""
        if not url.endswith(".json"):
            url = f"{url.rstrip('/')}/{MANIFEST_NAME}"
        buffer = io.BytesIO()
        fetch(url, network, buffer)
        try:
            raw = json.loads(buffer.getvalue())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"{url} is not valid JSON ({exc}): is this URL a split's manifest.json?") from None
        manifest = cls.from_dict(raw, url=url)
        manifest.network = network
        return manifest

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path | None = None, url: str | None = None) -> Manifest:
        where = url or (str(path) if path else "manifest")
        required = ("dataset", "split", "modality", "classes", "num_samples", "shards", "fields", "info",
                    "source", "recipe", "recipe_version")
        missing = [k for k in required if k not in raw]
        if missing:
            raise DataError(f"{where}: missing field(s) {missing}; rebuild the split with its data/ recipe")
        known = {f for f in cls.__dataclass_fields__ if f not in _PLACE_FIELDS}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise DataError(f"{where}: unknown field(s) {unknown}; was it written by a newer patchplace?")
        if raw.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
            raise DataError(f"{where}: format_version {raw['format_version']} is newer than {FORMAT_VERSION}; "
                            "upgrade patchplace-data")
        try:
            shards = [ShardInfo(**s) for s in raw["shards"]]
            manifest = cls(**{**raw, "shards": shards}, path=path, url=url)
            manifest.validate()
        except (TypeError, AttributeError, KeyError) as exc:  # a field of the wrong type (e.g. "count": "x")
            raise DataError(f"{where}: a field has the wrong type or shape ({type(exc).__name__}: {exc}); rebuild "
                            "the split with its data/ recipe") from None
        return manifest

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in _PLACE_FIELDS:
            d.pop(key)
        return d

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically to ``path`` (a directory gets ``manifest.json`` inside)."""
        self.validate()
        path = Path(path)
        file = path / MANIFEST_NAME if path.is_dir() or path.suffix != ".json" else path
        write_json_atomic(file, self.to_dict())
        self.path = file
        return file

    # ------------------------------------------------------------------ checks and derived facts
    def validate(self) -> None:
        where = str(self.path or self.url or "") or f"manifest of {self.dataset}/{self.split}"
        if self.modality not in MODALITIES:
            raise DataError(f"{where}: modality {self.modality!r} is not one of {MODALITIES}")
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise DataError(f"{where}: classes must be a non-empty list of unique names")
        if sum(s.count for s in self.shards) != self.num_samples:
            raise DataError(f"{where}: shard counts sum to {sum(s.count for s in self.shards)} "
                            f"but num_samples is {self.num_samples}")
        if self.class_counts is not None and (len(self.class_counts) != len(self.classes)
                                              or sum(self.class_counts) != self.num_samples):
            raise DataError(f"{where}: class_counts does not match classes / num_samples")
        if "input" not in self.fields or "label" not in self.fields:
            raise DataError(f"{where}: fields must name an 'input' and a 'label' member extension")
        if self.normalization is not None:
            mean, std = self.normalization.get("mean"), self.normalization.get("std")
            if not mean or not std or len(mean) != len(std) or min(std) <= 0:
                raise DataError(f"{where}: normalization needs equal-length mean/std lists with std > 0")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def directory(self) -> Path:
        if self.path is None:
            raise DataError(f"manifest of {self.dataset}/{self.split} was not loaded from disk; pass urls explicitly")
        return self.path.parent

    @property
    def location(self) -> str:
        """Where the split is: its directory, or its URL when it was loaded from one."""
        return self.url.rsplit("/", 1)[0] if self.url else str(self.directory)

    def shard_urls(self) -> list[str]:
        """The shards next to the manifest: local paths, or URLs for a manifest loaded from a URL (an object
        store's keys are not percent-encoded)."""
        if self.url:
            encode = quote if url_scheme(self.url) in SCHEMES else str
            return [f"{self.location}/{encode(s.name)}" for s in self.shards]
        return [str(self.directory / s.name) for s in self.shards]

    def fingerprint(self) -> str:
        """sha256 of what the split *is* (classes, shard hashes, fields, info, normalization), not of where it
        came from: checkpoints record it to name the data they were trained on, on any machine."""
        content = {k: v for k, v in self.to_dict().items() if k in _CONTENT_FIELDS}
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def summary(self) -> str:
        """A few human-readable lines (printed by `python -m patchplace.data show`)."""
        lines = [f"{self.dataset}/{self.split}: {self.num_samples} {self.modality} samples in "
                 f"{len(self.shards)} shard(s), {self.num_classes} classes  [recipe {self.recipe} "
                 f"v{self.recipe_version}]"]
        if self.class_counts is not None:
            pairs = zip(self.classes, self.class_counts, strict=True)
            lines.append("  classes: " + ", ".join(f"{c}={n}" for c, n in pairs))
        else:
            lines.append("  classes: " + ", ".join(self.classes))
        lines.append("  info: " + ", ".join(f"{k}={v}" for k, v in self.info.items()))
        if self.normalization:
            mean = ", ".join(f"{m:.4f}" for m in self.normalization["mean"])
            std = ", ".join(f"{s:.4f}" for s in self.normalization["std"])
            lines.append(f"  normalization: mean=[{mean}] std=[{std}] "
                         f"(from {self.normalization.get('computed_on', '?')})")
        lines.append(f"  source: {self.source}")
        lines.append(f"  fingerprint: {self.fingerprint()[:16]}")
        return "\n".join(lines)


def dataset_dir_hint(path: str | os.PathLike) -> str | None:
    """For a dataset directory (what a recipe's ``--out`` writes) given where a split is expected: the message
    naming its splits; None otherwise."""
    path = Path(path)
    splits = sorted(p.name for p in path.iterdir() if (p / MANIFEST_NAME).is_file()) if path.is_dir() else []
    if not splits:
        return None
    return f"{path} is a dataset directory, not a split: use one of its splits " \
           f"({', '.join(str(path / s) for s in splits)})"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_split(manifest: Manifest) -> list[str]:
    """Check every shard's presence, size and sha256 against the manifest; return the problems found. The shards
    of a manifest loaded from a URL are fetched (:class:`~patchplace.data.remote.RemoteError` when one cannot be)."""
    if manifest.url:
        return _verify_remote(manifest)
    problems = []
    for shard in manifest.shards:
        file = manifest.directory / shard.name
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != shard.bytes:
            problems.append(f"{file}: {file.stat().st_size} bytes, manifest says {shard.bytes} (truncated?)")
        elif sha256_file(file) != shard.sha256:
            problems.append(f"{file}: sha256 differs from the manifest (corrupt or rewritten)")
    return problems


def _verify_remote(manifest: Manifest) -> list[str]:
    from .integrity import mismatch  # (integrity reads manifest entries: imported here, not at the top)

    problems = []
    for url, shard in zip(manifest.shard_urls(), manifest.shards, strict=True):
        problem = mismatch(shard, *fetch(url, manifest.network or Network()))
        if problem:
            problems.append(f"{url}: {problem}")
    return problems


def class_list(names: list[str], shown: int = 6) -> str:
    """``[a, b, c]`` (``[a, b, ..., z] (N classes)`` when long), for one-line messages."""
    names = [str(n) for n in names]
    if len(names) <= shown:
        return f"[{', '.join(names)}]"
    return f"[{', '.join(names[:shown - 1])}, ..., {names[-1]}] ({len(names)} classes)"


def first_difference(model: list[str], data: list[str]) -> str:
    """Where two class lists first part: ``label 2 is 'c' for the model, 'z' in the data``."""
    for i in range(max(len(model), len(data))):
        mine, theirs = (repr(v[i]) if i < len(v) else "absent" for v in (model, data))
        if mine != theirs:
            return f"label {i} is {mine} for the model, {theirs} in the data"
    return "the same"
