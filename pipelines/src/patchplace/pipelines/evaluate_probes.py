"""evaluate.py's frozen-feature probes: the feature stores every process extracts its share of, the classification
each process scores its share of, and the probes the main process trains from the stores (linear, low-label,
label-fraction and subset-list probes, the position probe)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from patchplace.data.memory import balanced_subset
from patchplace.finetune import (
    FeatureStore,
    ProbeRecipe,
    feature_names,
    match_subset,
    pooled_features,
    position_probe,
    read_subset_file,
    score,
    standardization,
    subsample_per_class,
    train_probe,
)
from patchplace.finetune.probe_recipes import logistic_regression_chunked
from patchplace.pipelines.commands import EvalSection, EvaluateConfig
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import Data, classify
from patchplace.pipelines.evaluation import Ranks, SharedBatches, ordered_batches, split_size, store_split


@dataclass
class Stores:
    """The stored features of an evaluation: data.train's (``probe``: the rows of the probe's samples) and
    data.val's; None where no probe needs them."""

    train: FeatureStore | None
    val: FeatureStore | None
    probe: np.ndarray


def split_rows(reader) -> int:
    """The samples of a split evaluation reads: all, or the first data.train_limit / data.val_limit."""
    return min(split_size(reader), reader.epoch_length or split_size(reader))


def probe_positions(rows: int, samples: int | None, seed: int) -> torch.Tensor:
    """Sorted positions (manifest order) of the probe's train samples: all ``rows``, or ``samples`` of them drawn
    by ``seed`` (the same ones on any number of processes; shards written class by class are covered evenly)."""
    if not samples or samples >= rows:
        return torch.arange(rows)
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:samples].sort().values


def stored_features(ev: EvalSection, depth: int) -> list[str]:
    """The features the asked probes read (finetune.feature_store names)."""
    low_label = ev.label_fractions or ev.label_subset_files
    return feature_names(depth, last=(ev.linear_probe and "last" in ev.probe_layers) or bool(low_label)
                         or (ev.linear_probe and ev.low_label_fraction > 0),
                         last4=ev.linear_probe and "last4" in ev.probe_layers, blocks=ev.knn)


def build_stores(cfg: EvaluateConfig, data: Data, backbone, pool: str, device, ranks: Ranks) -> Stores:
    """Every process extracts its share of the samples the probes need into ``run.output/features/<split>``
    (finetune.FeatureStore): data.train's probe samples (all of data.train for eval.label_fractions /
    eval.label_subset_files) and the whole data.val; memory: a batch, whatever the splits' size."""
    ev, folder = cfg.eval, Path(cfg.run.output) / "features"
    train_rows = split_rows(data.train)
    probe = probe_positions(train_rows, ev.probe_train_samples, cfg.run.seed)
    names = stored_features(ev, len(backbone.blocks))
    if not names:
        return Stores(None, None, probe.numpy())
    if ranks.main:  # an earlier evaluation's features go (each process then writes only its own part)
        shutil.rmtree(folder, ignore_errors=True)
    ranks.barrier()

    def extract(x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.to(device)
        return pooled_features(backbone, data.frontend(x) if data.frontend is not None else x, pool, names)

    wanted = torch.arange(train_rows) if ev.label_fractions or ev.label_subset_files else probe
    say(ranks, f"features: {', '.join(names)} of {len(wanted)} data.train and {split_rows(data.val)} data.val "
        f"samples on {ranks.world} process(es), stored in {folder}")
    train = store_split("data.train", data.train, wanted, names, extract, folder / "train", ranks,
                        cfg.data.batch_size)
    val = store_split("data.val", data.val, torch.arange(split_rows(data.val)), names, extract, folder / "val",
                      ranks, cfg.data.batch_size)
    return Stores(train, val, np.searchsorted(np.asarray(train.positions), probe.numpy()))


def say(ranks: Ranks, text: str) -> None:
    if ranks.main:
        print(text, flush=True)


def shared_classification(backbone, data: Data, batch_size: int, device, ranks: Ranks) -> dict[str, Any]:
    """Top-1 / top-5 / confusion of the checkpoint's head on data.val, each process scoring its share; the counts
    are summed (exactly what one process counts)."""
    share = SharedBatches(data.val, torch.arange(split_rows(data.val)), ranks)
    mine = classify(backbone, share, batch_size, device, data.frontend)
    confusion = torch.tensor(mine["confusion"], dtype=torch.int64)
    counts = torch.tensor([mine["count"], int(confusion.trace()), round(mine["top5"] * mine["count"])])
    total = ranks.total(torch.cat([counts, confusion.flatten()]))
    n = max(int(total[0]), 1)
    return {"top1": int(total[1]) / n, "top5": int(total[2]) / n, "count": int(total[0]),
            "confusion": total[3:].reshape(confusion.shape).tolist()}


def recipe_probe(recipe: ProbeRecipe, stores: Stores, name: str, rows: np.ndarray, num_classes: int, device,
                 seed: int, desc: str) -> dict[str, Any]:
    """The linear probe of ``recipe`` on the train store's ``rows`` of feature ``name``, scored on data.val."""
    from tqdm import tqdm

    def batch(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return stores.train.rows(name, rows[index.numpy()])

    with tqdm(total=recipe.epochs, desc=desc, unit="epoch", leave=False) as bar:
        head = train_probe(recipe, batch, len(rows), stores.train.dims[name], num_classes, seed=seed,
                           device=device, progress=bar.update)
    scored = score(head, stores.val.chunks(name), device)
    return {"top1": scored["top1"], "top5": scored["top5"], "train_samples": len(rows), "feature": name,
            "dim": stores.train.dims[name]}


def logistic_probe(stores: Stores, rows: np.ndarray, num_classes: int, lambd: float) -> dict[str, Any]:
    """StoP's low-shot probe (logistic_eval.py) on the train store's ``rows`` of the last layer: the regression
    on the rows standardized by their own statistics; data.val's features standardized by data.val's own, as the
    authors' script does. The rows are read from the store chunk by chunk at every objective evaluation
    (:func:`logistic_regression_chunked`): memory of the weights, not of the rows."""
    model = logistic_regression_chunked(lambda: stores.train.chunks("last", rows), num_classes, lambd)
    mean, std = standardization(x for x, _ in stores.val.chunks("last"))
    scored = score(lambda v: model.logits(v.cpu(), mean, std), stores.val.chunks("last"))
    return {"top1": scored["top1"], "top5": scored["top5"], "train_samples": len(rows), "feature": "last",
            "lambda": lambd, "iterations": model.iterations}


def label_probe(ev: EvalSection, stores: Stores, rows: np.ndarray, num_classes: int, device, seed: int,
                desc: str) -> dict[str, Any]:
    """The low-label probe of eval.label_probe on ``rows`` (sorted) of the train store."""
    if ev.label_probe == "logistic":
        return {**logistic_probe(stores, rows, num_classes, ev.logistic_lambda), "solver": "logistic"}
    return {**recipe_probe(ev.recipe(), stores, "last", rows, num_classes, device, seed, desc), "solver": "linear"}


def frozen_probes(cfg: EvaluateConfig, stores: Stores, num_classes: int, device) -> dict[str, Any]:
    """The linear probes (eval.probe_layers), the low-label probes and the label-fraction / subset-list probes,
    trained on the main process from the stores."""
    ev, seed, out = cfg.eval, cfg.run.seed, {}
    recipe = ev.recipe()
    if ev.linear_probe:
        for layer in ev.probe_layers:
            key = "linear_probe" if layer == "last" else "linear_probe_last4"
            out[key] = {**recipe_probe(recipe, stores, layer, stores.probe, num_classes, device, seed,
                                       f"linear probe ({layer})"), "recipe": recipe.record()}
        if ev.low_label_fraction > 0:
            labels = torch.from_numpy(np.asarray(stores.train.labels[stores.probe]))
            few = stores.probe[subsample_per_class(labels, ev.low_label_fraction).numpy()]
            out["linear_probe_low_label"] = {**label_probe(ev, stores, few, num_classes, device, seed,
                                                           f"{ev.low_label_fraction:.0%} of the probe's labels"),
                                             "fraction": ev.low_label_fraction}
    if ev.label_fractions:
        labels = torch.from_numpy(np.array(stores.train.labels))
        out["linear_probe_label_fraction"] = {
            f"{fraction:g}": {**label_probe(ev, stores, balanced_subset(labels, fraction, cfg.data.label_subset_seed)
                                            .numpy(), num_classes, device, seed, f"{fraction:.0%} of the labels"),
                              "label_subset_seed": cfg.data.label_subset_seed} for fraction in ev.label_fractions}
    if ev.label_subset_files:
        out["linear_probe_label_subset"] = {}
        for file in ev.label_subset_files:
            rows = match_subset(stores.train.key_chunks(), read_subset_file(file), f"eval.label_subset_files {file}")
            check_subset_classes(np.asarray(stores.train.labels[rows]), file)
            out["linear_probe_label_subset"][Path(file).name] = {
                **label_probe(ev, stores, rows, num_classes, device, seed, Path(file).name), "file": file}
    return out


def check_subset_classes(labels: np.ndarray, file: str, classes: list[str] | None = None) -> None:
    """A label subset of one class trains no classifier: refused, naming the class."""
    found = np.unique(labels)
    if len(found) < 2:
        name = repr(classes[int(found[0])]) if classes else f"label {int(found[0])}"
        raise ConfigError(f"eval.label_subset_files {file} lists {len(labels)} samples, all of class "
                          f"{name}: a probe needs samples of two classes or more (list the "
                          "subset's samples of every class)")


def positions_batches(data: Data, reader, positions: torch.Tensor, batch_size: int, device
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, labels)`` of ``positions`` of a split, read batch by batch on this process (the frontend on), in
    the same batches from memory or streamed (:func:`ordered_batches`)."""
    for x, y in ordered_batches(reader, positions, batch_size):
        x = x.to(device)
        yield (data.frontend(x) if data.frontend is not None else x), y


def position_results(cfg: EvaluateConfig, data: Data, backbone, stores: Stores, pool: str, device) -> dict[str, Any]:
    """The position probe (DropPos Table 7) on the probe's train samples and all of data.val, read batch by batch
    (main process)."""
    bs = cfg.data.batch_size
    probe = torch.from_numpy(np.asarray(stores.train.positions[stores.probe])) if stores.train is not None \
        else probe_positions(split_rows(data.train), cfg.eval.probe_train_samples, cfg.run.seed)
    return position_probe(backbone, positions_batches(data, data.train, probe, bs, device),
                          positions_batches(data, data.val, torch.arange(split_rows(data.val)), bs, device),
                          device=device, class_token=pool != "patch_mean")
