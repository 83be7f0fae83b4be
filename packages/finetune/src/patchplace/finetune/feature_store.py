"""Frozen-backbone features of a split on disk, computed batch by batch on any number of processes and merged in
one canonical order, so that every probe reads them in bounded memory and gets the same numbers on 1 or N processes.

While extracting, each process appends the rows of its share to ``<folder>/part-<rank>/`` (one raw float32 file a
feature, the labels, the samples' positions in the split and their keys; memory: one batch). :func:`merge_parts`
then puts every part's rows in the order of their positions (a sample's index in the split's manifest order: the
order one process reads) into ``<name>.npy`` (float32 ``(N, D)``, ``np.load(..., mmap_mode="r")`` reads it),
``labels.npy``, ``positions.npy``, ``keys.npy`` and ``store.json``; each process merges its share of the features.
:class:`FeatureStore` reads them back as memory maps.

Feature names (:func:`pooled_features`): ``last`` — the last block's final-normed output, pooled with the probe
feature (``cls`` / ``mean`` / ``patch_mean``); ``last4`` — the last 4 blocks' final-normed outputs, each pooled,
concatenated ("Stochastic positional embeddings improve masked image modeling", arXiv 2308.00566, §4.1 / Table 1
"100%, last 4 layers", the I-JEPA protocol it follows); ``block<i>`` — block ``i``'s (1-based) output before the
final norm, average-pooled (the layer-wise kNN probe of MP3, arXiv 2207.07611, App. C).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from patchplace.models import Backbone

from .probes import _pool, check_feature, embed_tokens

LAST_LAYERS = 4  # the "last 4 layers" of StoP Table 1 / I-JEPA's concatenated probe
MERGE_ROWS = 4096  # rows gathered / read at a time while merging and scoring (bounded memory)
CHUNK_BYTES = 8 << 20  # float32 a chunk read for scoring / the logistic regression holds at most (wide features)
# image extensions a key may end with ("n01440764__n01440764_10026_JPEG": image_folder.py turns '.' and '/' into '_')
IMAGE_EXTENSIONS = ("jpeg", "jpg", "png", "bmp", "webp", "tif", "tiff", "ppm", "pgm", "gif")


class StoreError(ValueError):
    """A store that cannot be built or read as asked (a count that differs, a part missing, a subset file naming
    samples the split lacks); the message names the cause and the fix."""


def feature_names(depth: int, *, last: bool = True, last4: bool = False, blocks: bool = False) -> list[str]:
    """The stored features a set of probes needs (``blocks``: every block, for the layer-wise kNN)."""
    return ((["last"] if last else []) + (["last4"] if last4 else [])
            + ([f"block{i}" for i in range(1, depth + 1)] if blocks else []))


def last_layers(depth: int) -> int:
    """Blocks the ``last4`` feature concatenates: 4, or all of a shallower backbone."""
    return min(LAST_LAYERS, depth)


@torch.no_grad()
def pooled_features(backbone: Backbone, x: torch.Tensor, pool: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The features ``names`` of one batch in one forward pass (the caller puts ``backbone`` in eval mode).

    ``last`` / ``last4`` equal :func:`~patchplace.finetune.probes.layer_features` (``norm=True``) of the last block
    / of the last 4 blocks concatenated; ``block<i>`` its ``norm=False`` output of block ``i - 1`` pooled with
    ``mean`` when ``pool`` is ``cls`` (MP3 App. C averages the patch outputs), else with ``pool``."""
    check_feature(pool, backbone)
    depth = len(backbone.blocks)
    unknown = [n for n in names if n not in ("last", "last4") and not re.fullmatch(r"block\d+", n)]
    blocks = {int(n[5:]) - 1 for n in names if n.startswith("block")}
    if unknown or any(not 0 <= i < depth for i in blocks):
        raise StoreError(f"unknown feature(s) {unknown or sorted(blocks)} for a {depth}-block backbone")
    normed = set(range(depth - last_layers(depth), depth)) if "last4" in names else set()
    normed |= {depth - 1} if "last" in names else set()
    knn_pool = "mean" if pool == "cls" else pool
    out, pooled, h = {}, {}, embed_tokens(backbone, x, pool)
    for i, block in enumerate(backbone.blocks):
        h = block(h)
        if i in blocks:
            out[f"block{i + 1}"] = _pool(h, backbone, knn_pool)
        if i in normed:
            pooled[i] = _pool(backbone.norm(h), backbone, pool)
    if "last" in names:
        out["last"] = pooled[depth - 1]
    if "last4" in names:
        out["last4"] = torch.cat([pooled[i] for i in range(depth - last_layers(depth), depth)], dim=1)
    return {name: out[name].float() for name in names}


class FeatureWriter:
    """This process's part of a store: rows appended batch by batch to ``<folder>/part-<rank>/`` (the part is
    emptied first; each file is opened per batch, in append mode). Use as a context manager: ``part.json`` is
    written on a clean exit only, so a part cut short is never merged."""

    def __init__(self, folder: str | os.PathLike, rank: int) -> None:
        self.dir = Path(folder) / f"part-{rank}"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.count, self.dims = 0, {}
        for name in ("labels.i64", "positions.i64", "keys.txt"):
            (self.dir / name).write_bytes(b"")

    def _append(self, name: str, data: bytes) -> None:
        with open(self.dir / name, "ab") as handle:
            handle.write(data)

    def append(self, features: dict[str, torch.Tensor], labels: torch.Tensor, positions: torch.Tensor,
               keys: Sequence[str]) -> None:
        n = len(labels)
        if len(positions) != n or len(keys) != n or any(len(f) != n for f in features.values()):
            raise StoreError(f"a batch of {n} labels with {len(positions)} positions, {len(keys)} keys and features "
                             f"of {[len(f) for f in features.values()]} rows")
        for name, rows in features.items():
            rows = rows.detach().to("cpu", torch.float32).contiguous()
            self.dims.setdefault(name, int(rows.shape[1]))
            self._append(f"{name}.f32", rows.numpy().tobytes())
        self._append("labels.i64", labels.detach().cpu().to(torch.int64).numpy().tobytes())
        self._append("positions.i64", positions.detach().cpu().to(torch.int64).numpy().tobytes())
        self._append("keys.txt", "".join(f"{str(k).replace(chr(10), ' ')}\n" for k in keys).encode())
        self.count += n

    def __enter__(self) -> FeatureWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            (self.dir / "part.json").write_text(json.dumps({"count": self.count, "dims": self.dims}))


class Order:
    """Where each row of the merged store comes from: ``part`` and ``row`` per canonical row (sorted positions)."""

    def __init__(self, folder: Path, world: int) -> None:
        self.folder, self.world = folder, world
        self.parts = []
        for rank in range(world):
            meta = folder / f"part-{rank}" / "part.json"
            if not meta.is_file():
                raise StoreError(f"{meta} is missing: process {rank} wrote no complete part of the features (it "
                                 "failed, or run.output is not one folder every process shares: put it on a "
                                 "shared filesystem)")
            self.parts.append(json.loads(meta.read_text()))
        positions = np.concatenate([self._read(r, "positions.i64", np.int64) for r in range(world)])
        part = np.concatenate([np.full(p["count"], r, np.int32) for r, p in enumerate(self.parts)])
        row = np.concatenate([np.arange(p["count"], dtype=np.int64) for p in self.parts])
        order = np.argsort(positions, kind="stable")
        self.positions, self.part, self.row = positions[order], part[order], row[order]
        self.dims = {k: v for p in self.parts for k, v in p["dims"].items()}

    def __len__(self) -> int:
        return len(self.positions)

    def _read(self, rank: int, name: str, dtype: type) -> np.ndarray:
        return np.fromfile(self.folder / f"part-{rank}" / name, dtype=dtype)

    def duplicates(self) -> int:
        return int((np.diff(self.positions) == 0).sum())

    def gather(self, sources: list[np.ndarray | None], out: np.ndarray) -> None:
        """``out[i] = sources[part[i]][row[i]]``, :data:`MERGE_ROWS` rows at a time (fewer of rows wider than
        :data:`CHUNK_BYTES` / :data:`MERGE_ROWS`)."""
        step = max(1, min(MERGE_ROWS, CHUNK_BYTES // max(out.itemsize * int(np.prod(out.shape[1:])), 1)))
        for start in range(0, len(self), step):
            part, row = self.part[start:start + step], self.row[start:start + step]
            chunk = np.empty((len(part), *out.shape[1:]), out.dtype)
            for rank, source in enumerate(sources):
                mine = part == rank
                if mine.any():
                    chunk[mine] = source[row[mine]]
            out[start:start + len(part)] = chunk


def _save_npy(path: Path, shape: tuple[int, ...], dtype: np.dtype, fill) -> None:
    """Write ``path`` (a .npy) through a memory map, atomically (a temporary name, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
    fill(out)
    out.flush()
    del out
    os.replace(tmp, path)


def merge_feature(order: Order, name: str) -> None:
    """``<name>.npy``: the feature's rows of every part in canonical order."""
    dim = order.dims[name]
    sources = [np.memmap(order.folder / f"part-{r}" / f"{name}.f32", dtype=np.float32, mode="r",
                         shape=(p["count"], dim)) if p["count"] else None for r, p in enumerate(order.parts)]
    _save_npy(order.folder / f"{name}.npy", (len(order), dim), np.dtype(np.float32),
              lambda out: order.gather(sources, out))


def merge_meta(order: Order, split: str) -> None:
    """``labels.npy``, ``positions.npy``, ``keys.npy`` (fixed-width bytes) and ``store.json`` (written last: a
    store without it is incomplete)."""
    labels = [order._read(r, "labels.i64", np.int64) for r in range(order.world)]
    keys = [np.array(order._read(r, "keys.txt", np.uint8).tobytes().split(b"\n")[:-1], dtype=bytes)
            for r in range(order.world)]
    width = max((k.dtype.itemsize for k in keys if len(k)), default=1)
    keys = [k.astype(f"S{width}") for k in keys]
    _save_npy(order.folder / "labels.npy", (len(order),), np.dtype(np.int64), lambda out: order.gather(labels, out))
    _save_npy(order.folder / "keys.npy", (len(order),), np.dtype(f"S{width}"), lambda out: order.gather(keys, out))
    np.save(order.folder / "positions.npy", order.positions)
    (order.folder / "store.json").write_text(json.dumps({"split": split, "count": len(order), "dims": order.dims}))


def merge_parts(folder: str | os.PathLike, world: int, expected: int, split: str, *, rank: int = 0,
                names: Sequence[str] | None = None, meta: bool = True) -> None:
    """Merge the ``world`` parts of ``folder``: this process (``rank``) merges the features ``names[rank::world]``
    (default: all of them) and, when ``meta``, the labels / positions / keys. Raises :class:`StoreError` when the
    parts hold another number of rows than ``expected`` or a sample twice (every sample is read exactly once)."""
    order = Order(Path(folder), world)
    if len(order) != expected or order.duplicates():
        raise StoreError(f"the features of {split}: {world} process(es) read {len(order)} samples "
                         f"({order.duplicates()} twice) but {expected} were asked: each sample must be read "
                         "exactly once (a shard skipped as corrupt under data.skip_corrupt=true, or shards that "
                         "differ from their manifest); rebuild the split, or check it with `python -m "
                         "patchplace.data verify <split>`")
    for name in (names if names is not None else sorted(order.dims))[rank::world]:
        merge_feature(order, name)
    if meta:
        merge_meta(order, split)


class FeatureStore:
    """A merged store, read through memory maps: ``features(name)`` ``(N, D)`` float32, ``labels`` ``(N,)``,
    ``positions`` ``(N,)`` (sorted), ``keys`` ``(N,)`` bytes."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if not (self.folder / "store.json").is_file():
            raise StoreError(f"{self.folder} holds no complete feature store (no store.json)")
        meta = json.loads((self.folder / "store.json").read_text())
        self.split, self.count, self.dims = meta["split"], int(meta["count"]), meta["dims"]
        self.labels = np.load(self.folder / "labels.npy", mmap_mode="r")
        self.positions = np.load(self.folder / "positions.npy", mmap_mode="r")
        self.keys = np.load(self.folder / "keys.npy", mmap_mode="r")
        self._maps: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self.count

    def features(self, name: str) -> np.ndarray:
        if name not in self.dims:
            raise StoreError(f"{self.folder} stores {sorted(self.dims)}, not {name!r}")
        if name not in self._maps:  # one memory map a feature (file-backed pages, not the process's own memory)
            self._maps[name] = np.load(self.folder / f"{name}.npy", mmap_mode="r")
        return self._maps[name]

    def rows(self, name: str, index: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, labels) of the rows ``index`` (read in that order; sorted indices read fastest)."""
        index = np.asarray(index, dtype=np.int64)
        return (torch.from_numpy(np.ascontiguousarray(self.features(name)[index])),
                torch.from_numpy(np.ascontiguousarray(self.labels[index])))

    def chunk_rows(self, name: str) -> int:
        """Rows a chunk of feature ``name`` holds: :data:`MERGE_ROWS`, fewer for features wider than
        :data:`CHUNK_BYTES` / :data:`MERGE_ROWS` (ViT-H's 5,120-d last-4 concatenation: 409)."""
        return max(1, min(MERGE_ROWS, CHUNK_BYTES // (4 * max(int(self.dims[name]), 1))))

    def chunks(self, name: str, index: np.ndarray | None = None, size: int | None = None
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(features, labels) of the rows ``index`` (default: all), ``size`` rows at a time (default:
        :meth:`chunk_rows`): memory of one chunk, whatever the store's size."""
        index = np.arange(self.count) if index is None else np.asarray(index, dtype=np.int64)
        size = size or self.chunk_rows(name)
        for start in range(0, len(index), size):
            yield self.rows(name, index[start:start + size])

    def key_chunks(self, size: int = MERGE_ROWS) -> Iterator[tuple[int, list[str]]]:
        for start in range(0, self.count, size):
            yield start, [k.decode() for k in self.keys[start:start + size]]


# ---------------------------------------------------------------------------------------------- subset lists
def read_subset_file(path: str | os.PathLike) -> list[str]:
    """The sample names of a subset list, one a line (SimCLR's ImageNet ``1percent.txt`` / ``10percent.txt``:
    ``n01440764_10026.JPEG``); blank lines are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"subset list {path} cannot be read ({exc}): give a text file of sample names, one a "
                         "line") from None
    names = [line.strip() for line in lines if line.strip()]
    if not names:
        raise StoreError(f"subset list {path} names no sample")
    return names


def as_key(name: str) -> str:
    """A listed file name as data/image_folder.py keys it: '/' -> '__', then '.' -> '_'."""
    return re.sub(r"[./]", "_", name.replace("/", "__"))


def name_stem(name: str) -> str:
    """A listed name without its folders and extension (``train/n01/n01_7.JPEG`` -> ``n01_7``)."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[0] if "." in base else base


def key_stem(key: str) -> str:
    """A stored key without its folders and image extension (``n01__n01_7_JPEG`` -> ``n01_7``)."""
    base = key.rsplit("__", 1)[-1]
    head, _, ext = base.rpartition("_")
    return head if head and ext.lower() in IMAGE_EXTENSIONS else base


def match_subset(key_chunks: Iterable[tuple[int, Sequence[str]]], names: Sequence[str], source: str = "the list"
                 ) -> np.ndarray:
    """Sorted store rows of the listed ``names``: a name matches the key it is (or that image_folder.py makes of
    it, folders included), else the one key with its stem (folders and extension left out). A name no key matches,
    or whose stem several keys share, is refused (:class:`StoreError` naming a few of them). Memory: the list's
    names, whatever the store's size. A sample listed twice (the same line, or two names of one file) is refused
    too: the probe would train on fewer samples than the list names."""
    exact: dict[str, int] = {}
    stems: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        exact.setdefault(name, i)
        exact.setdefault(as_key(name), i)
        stems.setdefault(name_stem(name), []).append(i)
    by_key: dict[int, int] = {}
    by_stem: dict[int, list[int]] = {}
    for start, keys in key_chunks:
        for offset, key in enumerate(keys):
            if key in exact:
                by_key[exact[key]] = start + offset
            for i in stems.get(key_stem(key), ()):
                by_stem.setdefault(i, []).append(start + offset)
    rows, missing, ambiguous = [], [], []
    for i, name in enumerate(names):
        found = [by_key[i]] if i in by_key else by_stem.get(i, [])
        if len(found) == 1:
            rows.append(found[0])
        else:
            (ambiguous if found else missing).append(name)
    if missing or ambiguous:
        some = ", ".join((missing or ambiguous)[:3])
        what = (f"{len(missing)} of the {len(names)} names in {source} are not samples of the split (e.g. {some})"
                if missing else f"{len(ambiguous)} names in {source} match several samples (e.g. {some})")
        raise StoreError(f"{what}: list the split's own files, by name (n01440764_10026.JPEG) or by the path under "
                         "the split folder that data/image_folder.py keyed them by (n01440764/n01440764_10026.JPEG)")
    found = np.asarray(rows, dtype=np.int64)
    unique, first = np.unique(found, return_index=True)
    if len(unique) < len(found):  # the probe would train on fewer samples than the list names
        again = [names[i] for i in sorted(set(range(len(found))) - set(first.tolist()))]
        raise StoreError(f"{len(again)} of the {len(names)} names in {source} name a sample an earlier line names "
                         f"too (e.g. {', '.join(again[:3])}): list each sample once")
    return unique
