"""The readers of a run (:class:`Data`: each split in memory or streamed, normalized with the training statistics,
``data.holdout`` kept out of training), and what a checkpoint records about its data (classes, normalization,
fingerprints, hold-out) and checks against the model (:func:`check_inputs`)."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from patchplace.data import Manifest, ShardDataset, build_transform
from patchplace.data.batched import CROP_INTERPOLATIONS, build_batched_transform
from patchplace.data.memory import InMemorySplit, MemoryReader, balanced_subset, decoded_bytes
from patchplace.data.mfcc import build_frontend
from patchplace.models import Backbone
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.sections import HOLDOUT, DataSection


@dataclass
class Data:
    """The readers of one run — each a :class:`ShardDataset` (streaming) or a :class:`MemoryReader` (in memory,
    batched augmentation on the training device), behind the same ``batches(batch_size, epoch, skip)`` — plus the
    on-device speech frontend for audio manifests. ``path``: which one feeds each split, and why."""

    train: ShardDataset | MemoryReader
    val: ShardDataset | MemoryReader
    manifest: Manifest
    frontend: nn.Module | None
    path: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)  # when reading began (startup_s counts from here)
    # the mean / std every image split is normalized with: the training statistics (:func:`training_statistics`)
    normalization: dict[str, Any] | None = None
    # data.holdout: the labels of the whole data.train split, in manifest order (a hold-out is drawn from them)
    train_labels: torch.Tensor | None = None


def memory_choice(cfg: DataSection, manifest: Manifest, budget: int, key: str, augment: bool) -> str | None:
    """Why split ``key`` (``data.train`` / ``data.val``) must stream, or None when it can live in memory
    (``data.in_memory``: auto picks memory whenever it can, true insists, false streams)."""
    if cfg.in_memory is False:
        return "data.in_memory=false"
    need = decoded_bytes(manifest)
    if need is None:
        why = "its manifest gives no fixed image size / clip length"
    elif need > budget:
        why = (f"it takes {need / 2**20:.3g} MiB decoded, more than the {max(budget, 0) / 2**20:.3g} MiB left of "
               f"data.memory_budget_mb={cfg.memory_budget_mb:g}")
    elif key == "data.train" and augment and cfg.auto_augment:
        why = "data.auto_augment runs per sample on PIL images"
    elif per_sample_recipe(cfg, key, augment):
        why = per_sample_recipe(cfg, key, augment)
    else:
        return None
    if cfg.in_memory is True:
        raise ConfigError(f"data.in_memory=true but {key} ({manifest.dataset}/{manifest.split}) cannot be held in "
                          f"memory: {why}; set data.in_memory=auto to stream it")
    return why


def per_sample_recipe(cfg: DataSection, key: str, augment: bool) -> str | None:
    """The recipe fields the batched in-memory path cannot apply to split ``key`` (they run per sample on PIL
    images, or repeat samples of a stream), named; None when there are none."""
    augmented = key == "data.train" and augment
    found = [f"data.{name}={getattr(cfg, name)}" for name in ("grayscale", "gaussian_blur", "color_jitter")
             if augmented and getattr(cfg, name)]
    if augmented and cfg.re_prob and (cfg.re_mode, cfg.re_count) != ("const", 1):
        found.append(f"data.re_mode={cfg.re_mode} data.re_count={cfg.re_count}")
    if augmented and cfg.repeated_aug > 1:
        found.append(f"data.repeated_aug={cfg.repeated_aug}")
    if augmented and (cfg.interpolation or "bicubic") not in CROP_INTERPOLATIONS:  # the batched crop: grid_sample's
        found.append(f"data.interpolation={cfg.interpolation}")
    if not augmented and cfg.crop_pct != 1:  # batched resizing is not PIL's bicubic: timm's eval transform streams
        found.append(f"data.crop_pct={cfg.crop_pct}")
    return f"{', '.join(found)} run(s) per sample on the streaming path" if found else None


def build_data(cfg: DataSection, accelerator: Accelerator, seed: int, augment: bool = True,
               split_train: bool = True, checkpoint: str | None = None) -> Data:
    """Train reader split across processes (by global rank, so across nodes too: each process reads its own
    shards / samples); the validation reader is read whole by the main process. ``split_train=False``: the train
    reader is read whole as well. Each split is held in memory (batched augmentation on the training device) when
    ``data.in_memory`` and ``data.memory_budget_mb`` allow, else streamed from its shards; the choice is printed
    and logged with every step. Every split is normalized with the training statistics
    (:func:`training_statistics`: ``checkpoint``'s recorded ones, else data.train's), never its own."""
    started = time.perf_counter()
    holdout = cfg.val == HOLDOUT
    manifest = Manifest.load(cfg.train, cfg.network())  # carries data.timeout / retries to its http(s) shards
    val_manifest = manifest if holdout else Manifest.load(cfg.val, cfg.network())
    if manifest.classes != val_manifest.classes:
        raise ValueError(f"data.val classes differ from data.train classes ({cfg.val} vs {cfg.train})")
    if augment and accelerator.process_index == 0 and (line := upscale_warning(cfg, manifest)):
        print(line, file=sys.stderr)
    normalization = training_statistics(manifest, checkpoint)
    options, eval_options = transform_options(cfg, manifest, interpolation_in_force(cfg, checkpoint, augment))
    rank, world = (accelerator.process_index, accelerator.num_processes) if split_train else (0, 1)
    budget = int(cfg.memory_budget_mb * 2**20)
    readers, path, held, train_labels = {}, {}, None, None
    for key, m, urls, train, opts in (("data.train", manifest, cfg.train_urls, True, options),
                                      ("data.val", val_manifest, cfg.val_urls, False, eval_options)):
        why = None if holdout and not train else memory_choice(cfg, m, budget, key, augment)
        check_streamed(cfg, why, train)
        statistics = with_statistics(m, normalization)
        if why is None:
            if holdout and not train:
                split = held  # data.val=holdout: the samples held out of data.train
            else:
                split = InMemorySplit.load(m, budget, urls=urls, skip_corrupt=train and cfg.skip_corrupt,
                                           num_workers=cfg.num_workers, verify=cfg.verify_shards)  # in parallel
                budget -= decoded_bytes(m)
            if train:
                split, held, train_labels = training_subset(split, cfg, m.num_classes, accelerator)
            readers[key] = MemoryReader(split, build_batched_transform(statistics, augment and train, **opts),
                                        seed=seed, rank=rank if train else 0, world_size=world if train else 1,
                                        shuffle=train, device=accelerator.device)
            path[key.split(".")[1]] = "memory"
            accelerator.print(f"{key}: in memory on {accelerator.device} ({m.dataset}/{m.split}, {len(split)} "
                              f"samples, {decoded_bytes(m) / 2**20:.3g} MiB decoded), batched "
                              f"{'augmentation' if augment and train else 'preprocessing'} there")
        else:
            readers[key] = streamed_reader(cfg, m, urls, statistics, opts, train=train, augment=augment, seed=seed,
                                           rank=rank, world=world, split_train=split_train)
            path[key.split(".")[1]] = "streaming"
            accelerator.print(f"{key}: streaming from {len(m.shards)} shard(s) with {cfg.num_workers} worker(s) "
                              f"({why})")
    train, val = readers["data.train"], readers["data.val"]
    finish_readers(cfg, train, val, accelerator, split_train)
    frontend = build_frontend(getattr(cfg, "frontend", None)).to(accelerator.device) \
        if manifest.modality == "audio" else None
    return Data(train, val, manifest, frontend, path, started, normalization, train_labels)


# data.img_size above this multiple of data.train's fixed image side is warned about: a recipe's crop on images far
# smaller than its own (ImageNet's 224 px crop on 28 px digits: 8x, the ViT built for 224 px and the data's channels)
UPSCALE_WARNING = 4.0


def upscale_warning(cfg: DataSection, manifest: Manifest) -> str | None:
    """The warning line of a training crop (data.img_size) :data:`UPSCALE_WARNING` times or more the side of
    data.train's images (their manifest's fixed size); None otherwise, or for images of no fixed size."""
    native = manifest.info.get("image_size") if manifest.modality == "image" else None
    if not native or not cfg.img_size or cfg.img_size < UPSCALE_WARNING * max(native):
        return None
    channels = int(manifest.info.get("channels", 3))
    return (f"warning: data.train ({manifest.dataset}/{manifest.split}) holds {native[0]}x{native[1]} "
            f"{_image_kind(channels)} images and data.img_size={cfg.img_size} upsamples them "
            f"{cfg.img_size / max(native):.3g}x: a model for {cfg.img_size} px inputs of {channels} channel(s) trains "
            f"on {max(native)} px of content; set data.img_size near {max(native)} (or data.img_size=null and "
            "data.pad_to) for these images, or point data.train at images of the recipe's size")


def transform_options(cfg: DataSection, manifest: Manifest, interpolation: str | None = None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The transform options of data.train and of the unaugmented reads (audio: the noise bank only), resampling
    with ``interpolation`` (:func:`interpolation_in_force`; None: data.interpolation, else bicubic)."""
    if manifest.modality != "image":
        return {"noise_bank": cfg.noise_split}, {}
    options = dict(pad_to=cfg.pad_to, img_size=cfg.img_size, scale=cfg.scale, hflip=cfg.hflip,
                   auto_augment=cfg.auto_augment, re_prob=cfg.re_prob,
                   **{**recipe_options(cfg), **eval_recipe_options(cfg, interpolation)})
    return options, dict(pad_to=cfg.pad_to, img_size=cfg.img_size, **eval_recipe_options(cfg, interpolation))


def check_streamed(cfg: DataSection, why: str | None, train: bool) -> None:
    """data.holdout and data.label_fraction draw from data.train in memory: refused when it streams (``why``)."""
    if why is not None and train and cfg.holdout:
        raise ConfigError(f"data.holdout={cfg.holdout} needs data.train in memory, but it streams ({why}); set "
                          "data.in_memory=auto and enough data.memory_budget_mb")
    if why is not None and train and cfg.label_fraction is not None:
        raise ConfigError(f"data.label_fraction={cfg.label_fraction} needs data.train in memory, but it streams "
                          f"({why}); set data.in_memory=auto and enough data.memory_budget_mb")


def training_subset(split: InMemorySplit, cfg: DataSection, num_classes: int,
                    accelerator: Accelerator) -> tuple[InMemorySplit, InMemorySplit | None, torch.Tensor | None]:
    """What of data.train (in memory) trains: (the split, the hold-out, the whole split's labels). data.holdout is
    kept out whichever split validates (the same train images); data.label_fraction keeps a fixed balanced subset
    (the label-efficiency protocol)."""
    held, train_labels = None, None
    if cfg.holdout:
        train_labels = split.labels
        split, held = hold_out(split, cfg, accelerator)
    if cfg.label_fraction is not None:
        split = split.subset(balanced_subset(split.labels, cfg.label_fraction, cfg.label_subset_seed))
        per_class = torch.bincount(split.labels, minlength=num_classes).tolist()
        accelerator.print(f"data.train: {cfg.label_fraction:.4g} of the labels, {len(split)} samples "
                          f"({min(per_class)}-{max(per_class)} per class, data.label_subset_seed="
                          f"{cfg.label_subset_seed})")
    return split, held, train_labels


def streamed_reader(cfg: DataSection, m: Manifest, urls: Any, statistics: Any, opts: dict[str, Any], *,
                    train: bool, augment: bool, seed: int, rank: int, world: int,
                    split_train: bool) -> ShardDataset:
    """A split streamed from its shards: data.train shuffled, split by rank, augmented (seeded per sample);
    data.val read whole and in order."""
    if not train:
        return ShardDataset(m, urls=urls, transform=build_transform(statistics, False, **opts),
                            num_workers=cfg.num_workers, verify=cfg.verify_shards)
    return ShardDataset(m, urls=urls, transform=build_transform(statistics, augment, **opts),
                        shuffle_buffer=cfg.shuffle_buffer, seed=seed, rank=rank, world_size=world,
                        num_workers=cfg.num_workers, seeded_transforms=True, skip_corrupt=cfg.skip_corrupt,
                        verify=cfg.verify_shards, repeated_aug=cfg.repeated_aug if augment else 1,
                        batch_size=cfg.batch_size, drop_last=cfg.drop_last and split_train)


def finish_readers(cfg: DataSection, train: ShardDataset | MemoryReader, val: ShardDataset | MemoryReader,
                   accelerator: Accelerator, split_train: bool) -> None:
    """data.drop_last (training only: evaluation reads every sample), pinned streamed batches, the epoch limits
    (data.train_limit / data.val_limit) and the line on what a streamed data.train leaves out per epoch."""
    train.drop_last = cfg.drop_last and split_train
    for reader in (train, val):  # streamed batches go to the device by non_blocking copies
        if isinstance(reader, ShardDataset):
            reader.pin_memory = pins_memory(accelerator.device)
    for reader, key, limit in ((train, "data.train_limit", cfg.train_limit), (val, "data.val_limit", cfg.val_limit)):
        if limit is not None:  # epoch_length, checked here so that the message names the config key
            available = len(reader)
            if not 1 <= limit <= available:
                raise ConfigError(f"{key}={limit}: each process can read at most {available} samples per epoch of "
                                  f"{reader.manifest.dataset}/{reader.manifest.split} with "
                                  f"{reader.world_size} process(es); set it in [1, {available}] or null")
            reader.epoch_length = limit
    if isinstance(train, ShardDataset) and split_train and train.dropped(cfg.batch_size):
        n, world = sum(train.counts), train.world_size
        tail = train.dropped(cfg.batch_size) - n % world
        accelerator.print(f"data.train: {train.dropped(cfg.batch_size)} of {n} samples left out per epoch ("
                          f"{n % world} so that {world} process(es) read as many"
                          + (f", {tail} of ragged last batches under data.drop_last=true" if tail else "") + ")")


def pins_memory(device: torch.device) -> bool:
    """Whether the streamed loaders pin their batches: on CUDA, where a page-locked batch's host -> device copy
    runs without a staging copy and, ``non_blocking``, overlaps the step; elsewhere pinning only costs."""
    return torch.device(device).type == "cuda"


def recipe_options(cfg: DataSection) -> dict[str, Any]:
    """The image transform options of the papers' recipe fields; those left at their defaults are not passed, so a
    run without them builds the very transform it built before they existed."""
    options = dict(re_mode=cfg.re_mode, re_count=cfg.re_count, grayscale=cfg.grayscale,
                   gaussian_blur=cfg.gaussian_blur, color_distortion=cfg.color_jitter, **eval_recipe_options(cfg))
    defaults = dict(re_mode="const", re_count=1, grayscale=0.0, gaussian_blur=0.0, color_distortion=0.0)
    return {k: v for k, v in options.items() if v != defaults.get(k)}


def eval_recipe_options(cfg: DataSection, interpolation: str | None = None) -> dict[str, Any]:
    """data.crop_pct (timm's eval resize + centre crop) when it is not 1 and the interpolation (``interpolation``,
    else data.interpolation) when it is not bicubic: unaugmented reads (data.val, evaluation, data.train without
    augmentation) use them; the interpolation is the training crop's too."""
    kernel = interpolation or cfg.interpolation or "bicubic"
    return {**({"crop_pct": cfg.crop_pct} if cfg.crop_pct != 1 else {}),
            **({"interpolation": kernel} if kernel != "bicubic" else {})}


def interpolation_in_force(cfg: DataSection, checkpoint: str | None, augment: bool) -> str:
    """data.interpolation when set; else, for a run that does not train (evaluate.py: ``augment`` false), the one
    ``checkpoint`` recorded (:func:`data_metadata`: its evaluation resized so), bicubic when it records none; else
    bicubic (timm's default)."""
    if cfg.interpolation is not None:
        return cfg.interpolation
    if augment or not checkpoint:
        return "bicubic"
    from patchplace.models.hub import read_config

    return read_config(checkpoint)[1].get("interpolation") or "bicubic"


def training_statistics(manifest: Manifest, checkpoint: str | None) -> dict[str, Any] | None:
    """The mean / std every split of a run is normalized with: those ``checkpoint`` (fine-tuning, evaluation)
    records, which its export (model.json, the ONNX evaluator) and timm's transform of it use too; else (training
    from scratch) the train split's. A split's own statistics (a test split's ``computed_on: test``) never count:
    the deployed model is given the training ones. Recorded statistics for another channel count are left to
    :func:`check_inputs`, which names that mismatch."""
    own = manifest.normalization
    if manifest.modality != "image" or not checkpoint:
        return own
    from patchplace.models.hub import read_config

    recorded = read_config(checkpoint)[1].get("normalization")
    channels = int(manifest.info.get("channels", 3))
    if not recorded or len(recorded.get("mean") or []) != channels:
        return own
    return {"mean": list(recorded["mean"]), "std": list(recorded["std"]),
            "computed_on": recorded.get("computed_on", "the checkpoint's training data")}


def with_statistics(manifest: Manifest, normalization: dict[str, Any] | None) -> Manifest:
    """``manifest`` whose transforms normalize with ``normalization`` (the reader keeps the manifest as it is)."""
    if manifest.modality != "image" or normalization is None or normalization == manifest.normalization:
        return manifest
    return dataclasses.replace(manifest, normalization=normalization)


def hold_out(split: InMemorySplit, cfg: DataSection, accelerator: Accelerator) -> tuple[InMemorySplit,
                                                                                        InMemorySplit]:
    """(train without the held-out samples, the held-out samples): ``data.holdout`` class-balanced samples drawn
    by ``data.holdout_seed`` alone, so every method and run validates on the same images and never trains on
    them. Label subsets (``data.label_fraction``) are drawn from what remains."""
    if not 0 < cfg.holdout < len(split):
        raise ConfigError(f"data.holdout={cfg.holdout}: data.train holds {len(split)} samples; hold out fewer")
    held = holdout_indices(split.labels, cfg.holdout, cfg.holdout_seed)
    keep = torch.ones(len(split), dtype=torch.bool)
    keep[held] = False
    use = "for validation" if cfg.val == HOLDOUT else f"(unused here: data.val={cfg.val})"
    accelerator.print(f"data.holdout: {len(held)} class-balanced samples of data.train held out {use} "
                      f"(data.holdout_seed={cfg.holdout_seed}); data.train reads the other {int(keep.sum())}")
    return split.subset(keep.nonzero().flatten()), split.subset(held)


def holdout_indices(labels: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """The indices (into a whole split, in manifest order) of its ``data.holdout=size`` samples drawn by
    ``data.holdout_seed=seed``: what :func:`hold_out` keeps out of training, and evaluation recomputes from a
    checkpoint's record (:func:`data_metadata`). Empty for size 0."""
    if size <= 0:
        return torch.zeros(0, dtype=torch.int64)
    return balanced_subset(labels, size / len(labels), seed)


def frame_count(data: Data | None) -> dict[str, int]:
    """A fresh speech backbone's ``num_frames``: what the front end makes of the manifest's clips (``{}`` for
    images, or without a front end or a fixed clip length); ``model.overrides`` still win (and are then checked
    against the reader)."""
    clip = data.manifest.info.get("clip_samples") if data is not None and data.frontend is not None else None
    return {"num_frames": data.frontend.num_frames(clip)} if clip else {}


def data_metadata(data: Data, cfg: DataSection) -> dict[str, Any]:
    """What a checkpoint records about its data (classes, the normalization every split was given, manifest
    fingerprint, input layout) and its hold-out: the ``data.holdout`` samples of that split it never trained on
    (size and seed: :func:`hold_out` draws the same ones again), so evaluation can refuse the images it trained on."""
    m = data.manifest
    # native_size: the images' size before pad_to (timm's pretrained_cfg reproduces the padding from it); crop_pct
    # where evaluation resizes and centre-crops (ImageNet's 0.875) and interpolation where it is not bicubic (its
    # kernel): the export records them for ONNX Runtime, evaluate.py resizes with the recorded interpolation
    return {"classes": m.classes, "normalization": data.normalization, "modality": m.modality, "pad_to": cfg.pad_to,
            "img_size": cfg.img_size, "native_size": m.info.get("image_size") if m.modality == "image" else None,
            **({"crop_pct": cfg.crop_pct} if cfg.crop_pct != 1.0 else {}),
            **({"interpolation": cfg.interpolation} if m.modality == "image" and cfg.interpolation not in (
                None, "bicubic") else {}),
            **({"frontend": cfg.frontend} if m.modality == "audio" else {}),
            "data": {"dataset": m.dataset, "split": m.split, "fingerprint": m.fingerprint(),
                     "holdout": {"size": cfg.holdout, "seed": cfg.holdout_seed}}}


def data_fingerprints(data: Data, cfg: DataSection) -> dict[str, str]:
    """What ``data.train`` and ``data.val`` hold: their manifests' fingerprints (shard hashes, classes, layout; not
    their paths), ``holdout`` for data.val=holdout. Every checkpoint records them; a resume compares them."""
    found = {"data.train": data.manifest.fingerprint()}
    if cfg.val == HOLDOUT:
        found["data.val"] = HOLDOUT
    elif data.val is not None:
        found["data.val"] = data.val.manifest.fingerprint()
    return found


def metrics_split(cfg: DataSection) -> str:
    """The split a run's evaluations measure (a checkpoint's ``metrics_split``, named in its model card):
    ``holdout`` (held out of data.train) or data.val's last path component (``shards/fashion_mnist/test`` ->
    ``test``), with ``[:N]`` under data.val_limit (Hugging Face's slice notation)."""
    name = HOLDOUT if cfg.val == HOLDOUT else Path(str(cfg.val)).name
    limit = getattr(cfg, "val_limit", None)
    return f"{name}[:{limit}]" if limit else name


def check_inputs(backbone: Backbone, data: Data, source: str) -> None:
    """The backbone takes what the train reader yields (modality, image side, channels) — checked before training,
    so a mismatch is one line naming both instead of a shape error inside the model at step 1. ``source`` names
    where the backbone comes from (a checkpoint path or ``model.preset=...``)."""
    m, c = data.manifest, backbone.config
    if c.modality != m.modality:
        raise ConfigError(f"{source} is a model for {c.modality} but data.train ({m.dataset}/{m.split}) holds "
                          f"{m.modality}: use a {m.modality} checkpoint / preset, or {c.modality} data")
    if m.modality != "image":
        return check_val(backbone, data, source)
    side = getattr(data.train.transform, "size", None)
    if side is not None and side != c.img_size:
        raise ConfigError(f"the data give {side} px images (data.img_size / data.pad_to) but {source} takes "
                          f"{c.img_size} px: set data.img_size={c.img_size}"
                          + ("" if source.startswith("model.checkpoint") else
                             f", or build the model for {side} px with model.overrides={{img_size: {side}}}"))
    channels = int(m.info.get("channels", 3))
    if channels != c.in_chans:
        raise ConfigError(f"data.train images have {channels} channel(s) but {source} takes {c.in_chans}: use a "
                          "checkpoint / preset with the data's channels")
    check_val(backbone, data, source)


def _image_kind(channels: int) -> str:
    return {1: "grayscale", 3: "RGB"}.get(channels, f"{channels}-channel")


def check_val(backbone: Backbone, data: Data, source: str) -> None:
    """The backbone takes what the data.val reader yields (modality, channels, image side), checked like data.train
    before any step: an RGB model would otherwise score a grayscale split (its statistics broadcast one channel to
    three) and a grayscale model fail on an RGB one only at the first validation, after training."""
    reader, c = data.val, backbone.config
    m = getattr(reader, "manifest", None) or getattr(getattr(reader, "split", None), "manifest", None)
    if m is None or m is data.manifest:  # data.val=holdout: checked as data.train
        return
    where = f"data.val={m.location} ({m.dataset}/{m.split})"
    if m.modality != c.modality:
        raise ConfigError(f"{where} holds {m.modality} but {source} is a model for {c.modality}: point data.val at "
                          f"an {c.modality} split (as the model was trained on)")
    if m.modality != "image":
        return
    channels = int(m.info.get("channels", 3))
    if channels != c.in_chans:
        raise ConfigError(f"{where} holds {_image_kind(channels)} images ({channels} channel(s)) but {source} takes "
                          f"{_image_kind(c.in_chans)} ones (in_chans={c.in_chans}): point data.val at a split "
                          f"written with {c.in_chans} channel(s), " + ("as the checkpoint was trained on" if
                                                                      source.startswith("model.checkpoint") else
                                                                      "like data.train"))
    transform = getattr(reader, "transform", None)
    native = m.info.get("image_size")
    pad_to = getattr(getattr(transform, "cfg", None), "pad_to", None) or getattr(getattr(transform, "pad", None),
                                                                                  "size", None)
    if pad_to and native and max(native) > pad_to:
        raise ConfigError(f"{where} holds {native[0]}x{native[1]} images, larger than data.pad_to={pad_to} (padding "
                          f"never shrinks them) for {source}'s {c.img_size} px input: set data.pad_to=null and "
                          f"data.img_size={c.img_size} to resize and centre-crop them (data.crop_pct)")
    side = getattr(transform, "size", None)
    if side is not None and side != c.img_size:
        raise ConfigError(f"{where} gives {side} px images (its native size, data.img_size / data.pad_to) but {source} "
                          f"takes {c.img_size} px: set data.img_size={c.img_size} to resize and centre-crop them "
                          "(data.crop_pct)")


def pair_mixing(mixup: Callable | None, objective: nn.Module, knobs: str) -> Callable:
    """The training batch transform of timm's Mixup / CutMix (``mixup``; None: none): batches pass as they are in
    evaluation and when odd (timm mixes pairs), the first odd one with a warning naming ``knobs`` (the config fields
    that asked for it, e.g. ``finetune.mixup/cutmix``)."""
    warned: list[bool] = []

    def batch_transform(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if mixup is None or not objective.training:
            return x, y
        if len(x) % 2:
            if not warned:
                print(f"warning: {knobs} skipped on a batch of {len(x)} samples (timm mixes pairs: odd batches pass "
                      "unmixed); use an even data.batch_size / data.train_limit", file=sys.stderr)
                warned.append(True)
            return x, y
        return mixup(x, y)

    return batch_transform
