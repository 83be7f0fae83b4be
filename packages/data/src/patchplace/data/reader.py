"""Read shards with webdataset: deterministic shuffles, disjoint rank/worker splits, fixed epoch lengths.

>>> ds = ShardDataset("shards/fashion_mnist/train", transform=build_transform(m, train=True),
...                   shuffle_buffer=2000, seed=0, rank=rank, world_size=world, num_workers=2)
>>> loader = make_loader(ds, batch_size=128)
>>> for epoch in range(epochs):
...     ds.set_epoch(epoch)
...     for images, labels in loader: ...

The dataset plans each epoch with :func:`patchplace.data.plan.plan_epoch` (rank and world size come from the
caller, e.g. ``accelerator.process_index``), so every rank yields ``len(ds)`` samples, none twice per epoch.
URLs default to the shards next to the manifest (on disk, or where a manifest loaded from a URL came from:
``ShardDataset("http://host:8000/train")``, ``ShardDataset("s3://bucket/fashion_mnist/train")``); pass ``urls`` (a
list, a brace pattern such as ``/data/train-{000000..000099}.tar``, ``https://host/train-{000000..000099}.tar`` or
``pipe:curl -sf https://host/train-{000000..000099}.tar``) to read the same shards from elsewhere — the manifest
still provides counts, classes and normalization. Shards by URL (``http(s)://``, object stores' ``s3://``, ...) are
fetched with timeouts and retries (:mod:`patchplace.data.remote`, :mod:`patchplace.data.stores`); one that cannot be
fetched is a :class:`~patchplace.data.remote.RemoteError` naming the URL and the HTTP status, store or network
error, and a ``pipe:`` command that exits non-zero a :class:`~patchplace.data.remote.CommandError` naming its exit
status — never a corrupt shard.

Every shard is checked against the manifest when it is opened — size and sha256, before any of its samples is
used (:mod:`patchplace.data.integrity`; ``pipe:`` / remote URLs are hashed as they stream and spooled) — and every
decoded image against the manifest's ``image_size``: a shard that differs is a corrupt shard (an error naming it, or
skipped and counted with ``skip_corrupt``), an image of another size an error naming its shard and key.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import re
import tarfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .codecs import decode_image_bytes, decode_wav
from .errors import DataError
from .integrity import open_shard
from .manifest import Manifest
from .plan import WorkerPlan, even_plan, even_quotas, plan_epoch, worker_quotas_for_epoch
from .remote import PIPE, Network, RemoteError

_CORRUPT = (tarfile.TarError, OSError, EOFError, ValueError, KeyError)
_VARIABLE = re.compile(r"\$\{(\w+)\}")  # what webdataset's envsubst replaces
COPY_FIELD = "__copy__"  # repeated_aug: which copy of its sample a stream entry is


def expand_urls(urls: str | list[str]) -> list[str]:
    """Expand brace patterns (``a-{000..009}.tar``) and ``::``-joined lists the way webdataset does, except that a
    ``pipe:`` command's ``${VAR}`` is left to its shell (webdataset's :func:`~webdataset.shardlists.expand_urls`
    would put the environment variable ``WDS_VAR`` in its place): one that is neither in the environment nor
    assigned in the command is a :class:`DataError` naming it. Elsewhere ``${VAR}`` is webdataset's ``WDS_VAR``; an
    unset one is a :class:`DataError` too."""
    if not isinstance(urls, str):
        return [str(u) for u in urls]
    expanded: list[str] = []
    for url in urls.split("::"):
        if url.startswith(PIPE):
            check_shell_variables(url)
            # each ${VAR} hidden from webdataset's envsubst (as \0VAR\0: no brace, nothing to expand), then put back
            hidden = wds.shardlists.expand_urls(_VARIABLE.sub(lambda m: f"\0{m.group(1)}\0", url))
            expanded.extend(re.sub(r"\0(\w+)\0", r"${\1}", u) for u in hidden)
            continue
        if unset := [name for name in _VARIABLE.findall(url) if f"WDS_{name}" not in os.environ]:
            raise DataError(f"{url}: ${{{unset[0]}}} is read from the environment variable WDS_{unset[0]} "
                            f"(webdataset's URL expansion), which is not set: export WDS_{unset[0]}=..., or write "
                            "the path out")
        expanded.extend(wds.shardlists.expand_urls(url))
    return expanded


def check_shell_variables(url: str) -> None:
    """A ``pipe:`` command's ``${VAR}`` must be set for its shell: in this environment (which the command
    inherits) or by the command itself (``VAR=...``); an unset one would expand to nothing (``cat /train-000000.tar``
    then fails far from the cause)."""
    command = url[len(PIPE):]
    for name in _VARIABLE.findall(command):
        if name not in os.environ and not re.search(rf"(^|[\s;&|(]){name}=", command):
            raise DataError(f"{url}: the pipe: command uses ${{{name}}}, which is not set in this environment (the "
                            f"command's shell inherits it): export {name}=... before the run, or write the value out")


class ShardDataset(IterableDataset):
    """An epoch-planned, deterministic WebDataset reader for one split.

    Args:
        manifest: split directory, its ``manifest.json`` or a loaded :class:`Manifest`.
        urls: shard URLs overriding the local paths (same shards, same order as the manifest).
        transform: applied to the decoded input (uint8 ``(C, H, W)`` tensor for images, float32 waveform for
            audio); ``None`` leaves the decoded input.
        decode: ``False`` yields raw webdataset sample dicts (bytes), for tools that re-encode.
        shuffle_buffer: sample shuffle buffer size (0 = no sample shuffle, no shard shuffle).
        seed: base seed; the shard order and each worker's shuffle derive from (seed, epoch, rank, worker).
        rank, world_size: this process and the number of processes (nodes x GPUs).
        num_workers: the DataLoader's ``num_workers`` (needed to plan; :func:`make_loader` passes it on).
        split_by: ``auto`` | ``shard`` | ``sample`` (see :mod:`patchplace.data.plan`).
        epoch_length: cap on samples per rank per epoch (``with_epoch`` style).
        skip_corrupt: skip (and count in ``skipped``) unreadable, truncated or altered shards (a size or sha256
            that differs from the manifest) instead of raising; an ``http(s)`` shard that cannot be fetched is
            still an error (the server, not the shard).
        return_key: also yield each sample's ``__key__``.
        seeded_transforms: run ``transform`` under a random state derived from (seed, epoch, sample key), so
            augmentations are the same whatever the worker count and survive an exact resume (the caller's
            global RNG state is restored afterwards).
        verify: check each shard's size and sha256 against the manifest when it is opened (default); ``False``
            trusts the bytes (the sample counts are still checked).
        network: timeout and retries for ``http(s)`` shards (default: the manifest's, else :class:`Network`'s).
        repeated_aug: yield each sample this many times, independently augmented (DeiT's repeated augmentation,
            "Training data-efficient image transformers & distillation through attention", arXiv 2012.12877): the
            copies enter the shuffle buffer as the shard's bytes (each is decoded and augmented on its own; with
            ``seeded_transforms`` copy ``c > 0`` is keyed ``key#c``) and the epoch keeps its length, so it reads
            1 / ``repeated_aug`` of the distinct samples (exactly without a shuffle buffer; a buffer reads up to its
            size further ahead). Unlike timm's ``RASampler``, which deals an image's copies
            to different ranks, the copies stay on this rank and worker, mixed only by the shuffle buffer.
    """

    # batches() / make_loader(): page-locked batches, whose copies to a CUDA device can overlap compute
    # (``.to(device, non_blocking=True)``); the pipelines set it when their device is CUDA
    pin_memory: bool = False

    def __init__(
        self,
        manifest: str | os.PathLike | Manifest,
        *,
        urls: str | list[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        decode: bool = True,
        shuffle_buffer: int = 0,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        split_by: str = "auto",
        epoch_length: int | None = None,
        skip_corrupt: bool = False,
        return_key: bool = False,
        seeded_transforms: bool = False,
        verify: bool = True,
        network: Network | None = None,
        repeated_aug: int = 1,
        batch_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.manifest = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest, network)
        self.network = network or self.manifest.network or Network()
        self.urls = expand_urls(urls) if urls is not None else self.manifest.shard_urls()
        if len(self.urls) != len(self.manifest.shards):
            raise DataError(f"{len(self.urls)} shard URLs given but the manifest of "
                            f"{self.manifest.dataset}/{self.manifest.split} lists {len(self.manifest.shards)}")
        if shuffle_buffer < 0:
            raise DataError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
        if repeated_aug < 1:
            raise DataError(f"repeated_aug must be >= 1, got {repeated_aug}")
        self.repeated_aug = int(repeated_aug)
        self.counts = [s.count for s in self.manifest.shards]
        self.transform, self.decode, self.return_key = transform, decode, return_key
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.split_by, self.epoch_length, self.skip_corrupt = split_by, epoch_length, skip_corrupt
        self.seeded_transforms, self.verify = seeded_transforms, verify
        self.batch_size, self.drop_last = batch_size, drop_last
        self.epoch = 0
        self.skipped: list[str] = []
        len(self)  # validate the plan parameters now, not in a worker

    # ------------------------------------------------------------------ epoch bookkeeping
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order and shuffles to produce (call before iterating)."""
        self.epoch = int(epoch)

    def _quotas(self, batch_size: int | None = None) -> list[int]:
        batch_size = batch_size or self.batch_size
        if self._even(batch_size):
            per_rank = sum(self.counts) // self.world_size
            per_rank = min(per_rank, self.epoch_length) if self.epoch_length is not None else per_rank
            return even_quotas(per_rank, max(self.num_workers, 1), batch_size, self.drop_last)
        return self._shard_quotas(self.epoch_length)

    def _shard_quotas(self, epoch_length: int | None) -> list[int]:
        return worker_quotas_for_epoch(self.counts, epoch=self.epoch, seed=self.seed, world_size=self.world_size,
                                       num_workers=max(self.num_workers, 1), shuffle_shards=self.shuffle_buffer > 0,
                                       split_by=self.split_by, epoch_length=epoch_length)

    def _even(self, batch_size: int | None) -> bool:
        """Whether this epoch reads :func:`~patchplace.data.plan.even_plan` (``split_by='auto'``): where the shard
        plan would leave samples out beyond the ``len % world_size`` every rank needs to read as many, or (under
        ``drop_last``) would end a worker on a ragged batch. Otherwise the shard plan."""
        if self.split_by != "auto":
            return False
        target = sum(self.counts) // self.world_size
        if self.epoch_length is not None:
            target = min(target, self.epoch_length)
        whole = self._shard_quotas(None)
        if sum(whole) < target:
            return True
        quotas = self._shard_quotas(self.epoch_length) if self.epoch_length is not None else whole
        return bool(self.drop_last and batch_size and any(q % batch_size for q in quotas))

    def dropped(self, batch_size: int | None = None) -> int:
        """Samples of the split no rank reads this epoch (the epoch_length cap aside)."""
        if self.epoch_length is not None:
            return 0
        return sum(self.counts) - self.world_size * sum(self._quotas(batch_size))

    def __len__(self) -> int:
        return sum(self._quotas())

    def num_batches(self, batch_size: int, drop_last: bool | None = None) -> int:
        """Batches a DataLoader over this dataset yields this epoch (each worker batches its own samples);
        identical on every rank. ``drop_last`` defaults to the dataset's."""
        drop_last = self.drop_last if drop_last is None else drop_last
        per = (lambda q: q // batch_size) if drop_last else (lambda q: -(-q // batch_size))
        return sum(per(q) for q in self._quotas(batch_size))

    def batches(self, batch_size: int, epoch: int, skip: int = 0) -> Iterator[Any]:
        """This epoch's batches through a DataLoader whose worker seeds derive from (seed, epoch, rank), the first
        ``skip`` of them read and dropped (an exact resume replays the epoch's stream). The same interface as
        :class:`~patchplace.data.memory.MemoryReader`, so a training loop does not know which one feeds it."""
        self.set_epoch(epoch)
        self.batch_size = batch_size  # the workers plan whole batches of it (even plans)
        generator = torch.Generator().manual_seed(hash((self.seed, epoch, self.rank)) % 2**63)
        loader = DataLoader(self, batch_size=batch_size, num_workers=self.num_workers, generator=generator,
                            persistent_workers=False, drop_last=self.drop_last, pin_memory=self.pin_memory)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if num_workers != max(self.num_workers, 1):
            raise DataError(f"ShardDataset was planned for num_workers={self.num_workers} but the DataLoader "
                            f"runs {num_workers}: build the loader with make_loader() or pass the same value")
        if self._even(self.batch_size):
            plan = even_plan(self.counts, epoch=self.epoch, seed=self.seed, rank=self.rank,
                             world_size=self.world_size, worker=worker, num_workers=num_workers,
                             shuffle_shards=self.shuffle_buffer > 0, epoch_length=self.epoch_length,
                             batch_size=self.batch_size, drop_last=self.drop_last)
        else:
            plan = plan_epoch(len(self.urls), counts=self.counts, epoch=self.epoch, seed=self.seed,
                              rank=self.rank, world_size=self.world_size, worker=worker, num_workers=num_workers,
                              shuffle_shards=self.shuffle_buffer > 0, split_by=self.split_by,
                              epoch_length=self.epoch_length)
        stream: Iterator[dict] = self._planned_samples(plan)
        if self.repeated_aug > 1:  # before the shuffle: copies are spread by it, the quota cuts the longer stream
            stream = _repeated(stream, self.repeated_aug)
        if self.shuffle_buffer > 0:
            rng = random.Random(f"patchplace-samples-{self.seed}-{self.epoch}-{self.rank}-{worker}")
            stream = wds.filters._shuffle(stream, self.shuffle_buffer, self.shuffle_buffer, rng)
        for n, sample in enumerate(stream):
            if plan.quota is not None and n >= plan.quota:
                break
            yield self._prepare(sample)

    def _planned_samples(self, plan: WorkerPlan) -> Iterator[dict]:
        if plan.take is not None:  # an even plan: a contiguous run of the epoch stream, exactly
            yield from itertools.islice(itertools.chain.from_iterable(self._read_shard(s) for s in plan.own),
                                        plan.skip, plan.skip + plan.take)
            return
        for shard in plan.own:
            yield from self._read_shard(shard)
        index = 0  # position in the shared shards' concatenated stream
        for shard in plan.shared:
            for sample in self._read_shard(shard):
                if index % plan.stride == plan.offset:
                    yield sample
                index += 1

    def _read_shard(self, shard: int) -> Iterator[dict]:
        """All samples of one shard; a read error, bytes that differ from the manifest's size / sha256 (checked
        before the first sample) or a count that differs from the manifest is corruption."""
        url, expected = self.urls[shard], self.counts[shard]
        try:
            samples = open_shard(url, self.manifest.shards[shard], verify=self.verify, network=self.network)
        except RemoteError:  # the server or the network: not the shard's bytes
            raise
        except FileNotFoundError as exc:  # an OSError, but no bytes to call corrupt
            self._missing(url, exc)
            return
        except _CORRUPT as exc:
            self._corrupt(url, _reason(exc))
            return
        n = 0
        while True:
            try:
                sample = next(samples)
            except StopIteration:
                break
            except FileNotFoundError as exc:  # verify=False: the file is opened by the first read
                self._missing(url, exc)
                return
            except _CORRUPT as exc:
                self._corrupt(url, _reason(exc))
                return
            n += 1
            if not set(self.manifest.fields.values()) <= sample.keys():
                self._corrupt(url, f"sample {sample.get('__key__')} lacks ."
                                   + " or .".join(self.manifest.fields.values()))
                return
            yield sample
        if n != expected:
            self._corrupt(url, f"holds {n} samples, the manifest says {expected} (truncated?)")

    def _missing(self, url: str, exc: FileNotFoundError) -> None:
        """A shard the manifest lists that is not on disk: skipped and counted under ``skip_corrupt`` (as an
        unreadable one), else a :class:`DataError` naming it."""
        path = exc.filename or url
        if self.skip_corrupt:
            self.skipped.append(url)
            warnings.warn(f"skipping missing shard {path} (listed in the manifest)", stacklevel=3)
            return
        raise DataError(f"missing shard {path} (listed in the manifest): restore it, or rebuild the split")

    def _corrupt(self, url: str, why: str) -> None:
        if self.skip_corrupt:
            self.skipped.append(url)
            warnings.warn(f"skipping corrupt shard {url}: {why}", stacklevel=3)
            return
        m = self.manifest
        where = m.location if m.path is not None or m.url else Path(url).parent
        if url.startswith("pipe:"):  # what the command wrote differs, not (necessarily) the split it reads
            raise DataError(f"corrupt shard {url}: {why}; the command's output is not the shard: run it by hand "
                            "(a command that fails must exit non-zero, e.g. curl -f, not print an error page), or "
                            "skip bad shards (counted) with data.skip_corrupt=true")
        raise DataError(f"corrupt shard {url}: {why}; rebuild the split with its data/ recipe, check all shards "
                        f"with `python -m patchplace.data verify {where}`, or skip bad shards (counted) with "
                        "data.skip_corrupt=true (ShardDataset(skip_corrupt=True))")

    def _prepare(self, sample: dict) -> Any:
        if not self.decode:
            return sample
        m, key = self.manifest, sample["__key__"]
        fields = m.fields
        try:
            label = int(sample[fields["label"]])
        except ValueError:
            raise DataError(f"sample {key} in {sample.get('__url__')}: its .{fields['label']} is not a class index "
                            f"({bytes(sample[fields['label']])[:20]!r}): the shard is corrupt; rebuild it with its "
                            "data/ recipe (or set data.skip_corrupt=true to skip bad shards)") from None
        if not 0 <= label < m.num_classes:
            raise DataError(f"sample {key} in {sample.get('__url__')}: label {label} is outside the "
                            f"{m.num_classes} classes of the manifest ({m.dataset}/{m.split})")
        where = f"{sample.get('__url__')}:{key}"
        if m.modality == "image":
            x: Any = decode_image_bytes(sample[fields["input"]], int(m.info.get("channels", 3)), key=where)
            self._check_size(x, sample)
        else:
            x = torch.from_numpy(np.ascontiguousarray(self._wave(sample, where)))
        if self.transform is not None:
            copy = sample.get(COPY_FIELD, 0)  # repeated_aug: copy c > 0 draws its augmentation as key#c
            x = self._seeded(f"{key}#{copy}" if copy else key, x) if self.seeded_transforms else self.transform(x)
        return (x, label, key) if self.return_key else (x, label)

    def _check_size(self, image: torch.Tensor, sample: dict) -> None:
        """An image whose size differs from the manifest's ``image_size`` is an error (never cropped to fit)."""
        m, declared = self.manifest, self.manifest.info.get("image_size")
        if declared and tuple(image.shape[-2:]) != tuple(declared):
            h, w = image.shape[-2:]
            raise DataError(f"sample {sample['__key__']} in {sample.get('__url__')}: a {h}x{w} image, but the manifest "
                            f"of {m.dataset}/{m.split} declares image_size {declared[0]}x{declared[1]}: the shard does "
                            "not match its manifest; rebuild the split with its data/ recipe")

    def _wave(self, sample: dict, where: str) -> np.ndarray:
        """The sample's waveform; a WAV whose rate differs from the manifest's ``sample_rate`` is an error (shards
        are written at that rate; the clip *length* may vary: ``clip_samples`` is what transforms fix it to)."""
        m, rate = self.manifest, int(self.manifest.info["sample_rate"])
        wave, found = decode_wav(sample[self.manifest.fields["input"]], key=where)
        if found != rate:
            raise DataError(f"sample {sample['__key__']} in {sample.get('__url__')}: a {found} Hz WAV, but the "
                            f"manifest of {m.dataset}/{m.split} declares sample_rate {rate}: the shard does not match "
                            "its manifest; rebuild the split with its data/ recipe")
        return wave

    def _seeded(self, key: str, x: Any) -> Any:
        """Apply the transform with python's, numpy's and torch's RNGs seeded from (seed, epoch, key), then restore
        them (numpy's: timm's RandAugment picks its ops with ``np.random.choice``)."""
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}-{self.epoch}-{key}".encode()).digest()[:8], "little")
        state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed % 2**63)
            try:
                return self.transform(x)
            finally:
                random.setstate(state)
                np.random.set_state(np_state)


def _repeated(samples: Iterator[dict], copies: int) -> Iterator[dict]:
    """Each raw sample ``copies`` times, copy ``c`` marked with ``COPY_FIELD`` (repeated augmentation)."""
    for sample in samples:
        for copy in range(copies):
            yield {**sample, COPY_FIELD: copy}


def _reason(exc: BaseException) -> str:
    """One line on why a shard could not be read (a :class:`ShardMismatch` says it whole)."""
    if isinstance(exc, DataError):
        return str(exc)
    return f"{type(exc).__name__}: {exc.args[0] if exc.args else exc}"


def make_loader(dataset: ShardDataset, batch_size: int, *, drop_last: bool = False,
                pin_memory: bool | None = None, collate_fn: Callable | None = None) -> DataLoader:
    """A DataLoader whose worker count matches the dataset's plan (workers are re-created per epoch so
    ``set_epoch`` reaches them); ``pin_memory`` defaults to the dataset's."""
    pin = dataset.pin_memory if pin_memory is None else pin_memory
    return DataLoader(dataset, batch_size=batch_size, num_workers=dataset.num_workers, drop_last=drop_last,
                      pin_memory=pin, collate_fn=collate_fn, persistent_workers=False)
