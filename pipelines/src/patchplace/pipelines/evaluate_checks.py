"""What evaluate.py refuses before anything is computed, each in one line: images the checkpoint trained on, a
classifier on classes not its own, inputs the model cannot take, an unreadable saved objective, label-subset lists
naming samples data.train lacks (or one class only) and fewer probe samples than classes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from patchplace.data.manifest import class_list, first_difference
from patchplace.finetune import LAST_LAYERS, match_subset, read_subset_file
from patchplace.pipelines.commands import EvaluateConfig
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.curves import curve_method, objective_state
from patchplace.pipelines.engine import Data, check_inputs, holdout_indices
from patchplace.pipelines.evaluate_probes import check_subset_classes, split_rows
from patchplace.pipelines.evaluation import split_keys
from patchplace.pipelines.sections import HOLDOUT, DataSection


def trained_on(metadata: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(method, data record) of the checkpoint and of each checkpoint it was fine-tuned from: the splits whose
    images (all but the recorded hold-out) its weights learned from."""
    chain, node = [], metadata
    while isinstance(node, dict):
        if isinstance(node.get("data"), dict):
            chain.append((str(node.get("method") or "?"), node["data"]))
        node = node.get("pretrain_metadata")
    return chain


def check_unseen(cfg: DataSection, data: Data, metadata: dict[str, Any], checkpoint: str) -> None:
    """Refuse to score ``checkpoint`` on images it (or the checkpoint it was fine-tuned from) trained on: data.val
    being the split it trained on, or ``data.val=holdout`` drawing samples outside the hold-out it recorded (its
    size and seed give the same samples again: :func:`~patchplace.pipelines.engine.holdout_indices`)."""
    if cfg.val != HOLDOUT:
        m = data.val.manifest
        fingerprint = m.fingerprint()
        for method, record in trained_on(metadata):
            if record.get("fingerprint") == fingerprint:
                held = record.get("holdout") or {}
                size, seed = held.get("size") or 0, held.get("seed", 0)
                raise ConfigError(
                    f"data.val={cfg.val} is {m.dataset}/{m.split}, the split {checkpoint} ({method}) trained on"
                    + (f" (less its {size} held-out samples)" if size else "") + ": its score would count images it "
                    "learned from; evaluate it on a test split" + (
                        f", or on its hold-out: data.val=holdout data.holdout={size} data.holdout_seed={seed}"
                        if size else ""))
        return
    m, labels = data.manifest, data.train_labels
    chosen = set(holdout_indices(labels, cfg.holdout, cfg.holdout_seed).tolist())
    fingerprint = m.fingerprint()
    for method, record in trained_on(metadata):
        if record.get("fingerprint") != fingerprint:
            continue
        held = record.get("holdout")
        if not isinstance(held, dict):
            raise ConfigError(f"data.val=holdout: {checkpoint} ({method}) was trained on {m.dataset}/{m.split} and "
                              "records no hold-out (written before checkpoints recorded one), so it may have trained "
                              "on these images; evaluate it on a test split (data.val=<split directory>)")
        size, seed = int(held.get("size") or 0), int(held.get("seed") or 0)
        seen = len(chosen - set(holdout_indices(labels, size, seed).tolist()))
        if seen:
            kept = f"data.holdout={size} with data.holdout_seed={seed}" if size else "nothing (data.holdout=0)"
            again = f"data.holdout={size} data.holdout_seed={seed}, or on " if size else ""
            raise ConfigError(f"data.val=holdout (data.holdout={cfg.holdout}, data.holdout_seed={cfg.holdout_seed}): "
                              f"{seen} of its {len(chosen)} images are ones {checkpoint} ({method}) trained on, as it "
                              f"held out {kept} of {m.dataset}/{m.split}; evaluate it on {again}a test split "
                              "(data.val=<split directory>)")


def check_classes(backbone, metadata: dict[str, Any], data: Data, checkpoint: str) -> None:
    """A classifier is scored only on data whose classes (names and order) are its own: label i must mean what its
    output i means."""
    classes, m = metadata.get("classes"), data.manifest
    if not backbone.config.num_classes or backbone.config.num_classes != m.num_classes or not classes:
        return
    if list(classes) != list(m.classes):
        dataset = (metadata.get("data") or {}).get("dataset") or "its training data"
        raise ConfigError(f"{checkpoint} classifies {class_list(classes)} ({dataset}) but {m.dataset}/{m.split} holds "
                          f"{class_list(m.classes)} ({first_difference(classes, m.classes)}): its top-1 would compare "
                          f"unrelated labels; evaluate it on {dataset}, or fine-tune it on this data first")


def preflight(cfg: EvaluateConfig, data: Data, backbone, metadata: dict[str, Any]) -> None:
    """What would stop the evaluation half-way, or make its numbers wrong, checked before anything is computed."""
    checkpoint = cfg.model.checkpoint
    check_inputs(backbone, data, f"model.checkpoint={checkpoint}")
    check_classes(backbone, metadata, data, checkpoint)
    check_unseen(cfg.data, data, metadata, checkpoint)
    m = data.manifest
    if cfg.privacy.enabled and (m.modality != "image" or backbone.config.num_classes != m.num_classes):
        raise ConfigError(f"--privacy needs an image classifier for {m.num_classes} classes; {checkpoint} is not one "
                          "(fine-tune it first)")
    extras = Path(checkpoint) / "objective.safetensors"
    if m.modality == "image" and curve_method(metadata) is not None and extras.is_file():
        objective_state(extras)
    check_subset_files(cfg, data)
    check_probe_samples(cfg, m)
    if "last4" in cfg.eval.probe_layers and cfg.eval.linear_probe and len(backbone.blocks) < LAST_LAYERS:
        print(f"note: eval.probe_layers=last4 concatenates all {len(backbone.blocks)} blocks of {checkpoint} (fewer "
              f"than {LAST_LAYERS})", file=sys.stderr)


def check_subset_files(cfg: EvaluateConfig, data: Data) -> None:
    """Each eval.label_subset_files list names samples of data.train (each once) of two classes or more: matched
    against the split's keys before any feature is extracted (local shards' tar headers, or the split in memory;
    shards read by URL are matched once their features are stored)."""
    import tarfile

    for file in cfg.eval.label_subset_files:
        names, labels = read_subset_file(file), []
        chunks = split_keys(data.train, split_rows(data.train), labels)
        if chunks is None:
            continue
        try:
            rows = match_subset(chunks, names, f"eval.label_subset_files {file}")
        except (OSError, tarfile.TarError):  # a shard that cannot be listed: the reader names it when it reads it
            continue
        check_subset_classes(np.concatenate(labels)[rows], file, data.manifest.classes)


def check_probe_samples(cfg: EvaluateConfig, manifest) -> None:
    """eval.probe_train_samples below the number of classes leaves classes the linear and kNN probes never see
    (their top-1 would be bounded by the classes drawn, not the features): refused."""
    n, classes = cfg.eval.probe_train_samples, manifest.num_classes
    if (cfg.eval.linear_probe or cfg.eval.knn) and n and n < classes:
        raise ConfigError(f"eval.probe_train_samples={n} is fewer than the {classes} classes of "
                          f"{manifest.dataset}/{manifest.split}: the probes could not see every class; give at "
                          f"least {classes} (or 0: all of data.train)")
