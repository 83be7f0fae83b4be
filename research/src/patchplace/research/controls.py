"""Controls for the probe tables: what a linear probe and a kNN reach on raw pixels and on the features of a
randomly initialised backbone, on the same train subsets and test images as the methods' probes.

    python pipelines/controls.py --config pipelines/configs/controls_fashion_mnist.yaml
    python pipelines/controls.py --config pipelines/configs/controls_fashion_mnist.yaml --study results/study.json

A pretrained backbone's probe means something only above both: the raw pixels (the input itself, preprocessed as
the model sees it) and a random-init backbone of the same preset (what the architecture gives before any training;
one per seed). With ``--study``, every method's probe in that study's results is read against the random-init
control by the study's learned gate: "learned" only where a one-sided Welch t-test over >= 3 seeds on each side
finds it above the control at alpha 0.05, else "not learned at this budget".

Sets (``controls.*``): each class-balanced ``label_fractions`` subset of the train split (the subsets of the
study's label-efficiency rows: ``balanced_subset`` with ``data.label_subset_seed``, drawn from what ``data.holdout``
leaves) and the first ``probe_train_samples`` train images (the study's all-label probe set; 0: none); tested on
``data.val`` (capped by ``data.val_limit``, as the study's probes are; ``data.val=holdout``: the validation split).
Writes ``controls.json`` and ``controls.md`` to ``run.output``.

``controls.checkpoints``: checkpoints probed on the same sets and images beside the controls, each on the feature
its training trained (``probe_feature``) — e.g. the snapshots of one pretraining (``run.keep_epochs``), which makes
a learning curve ("does it learn here?") with its controls, the data decoded once for all of them.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.research.controls`, before the imports below load torch: the
    # arguments parse without it (--help, a usage error), then this module runs imported by its name
    from patchplace.research import cli

    sys.exit(cli.main("controls"))

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from patchplace.data.memory import MemoryReader, balanced_subset
from patchplace.finetune import extract_features, knn_classify, probe_feature_of
from patchplace.models import create_model, load_pretrained
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import USER_ERRORS, start
from patchplace.pipelines.evaluation import first_images, probe
from patchplace.research.cli import ControlsConfig, ControlsSection, split_study
from patchplace.research.reproduction.claims import ALPHA, MIN_SEEDS, random_key, welch_greater
from patchplace.research.reproduction.plan import RUNS

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def train_sets(data, cfg: ControlsConfig) -> dict[str, Batches]:
    """{name: batches} of the probe train sets, preprocessed as for evaluation (no augmentation)."""
    c, bs = cfg.controls, cfg.data.batch_size
    if not isinstance(data.train, MemoryReader):
        raise ConfigError("controls need data.train in memory (data.in_memory=auto and enough data.memory_budget_mb)")
    sets: dict[str, Batches] = {}
    split = data.train.split
    chosen = {fraction: balanced_subset(split.labels, fraction, cfg.data.label_subset_seed)
              for fraction in c.label_fractions}
    for fraction, other in itertools.combinations(chosen, 2):
        if torch.equal(chosen[fraction], chosen[other]):  # max(1, round(f x per class)) alike: one column twice
            m, counts, n = data.manifest, torch.bincount(split.labels).tolist(), len(chosen[fraction])
            raise ConfigError(f"controls.label_fractions {fraction:g} and {other:g} pick the same {n} "
                              f"samples of data.train ({m.dataset}/{m.split}: {len(split)} samples, "
                              f"{min(counts)}-{max(counts)} per class, at least 1 each): their columns would be one "
                              "probe twice; drop one of them, or use a larger train split")
    for fraction in c.label_fractions:
        subset = MemoryReader(split.subset(chosen[fraction]), data.train.transform, shuffle=False,
                              device=data.train.device)
        sets[f"{fraction:g}"] = list(subset.batches(bs, epoch=0))
    if c.probe_train_samples:
        x, y = first_images(data.train, c.probe_train_samples, bs)
        sets["probe_set"] = list(zip(x.split(bs), y.split(bs), strict=True))
    return sets


def pixels(batches: Batches) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw-pixel features: each preprocessed image flattened."""
    return torch.cat([x.flatten(1).float().cpu() for x, _ in batches]), torch.cat([y.cpu() for _, y in batches])


def random_init(cfg: ControlsConfig, seed: int, in_chans: int, pos_embed: str = "") -> torch.nn.Module:
    """``model.preset`` at its initialisation for ``seed`` (with ``pos_embed`` when given)."""
    torch.manual_seed(seed)
    overrides = {**cfg.model.overrides, **({"pos_embed": pos_embed} if pos_embed else {})}
    return create_model(cfg.model.preset, in_chans=in_chans, num_classes=0, **overrides).eval()


def features(backbone: torch.nn.Module, batches: Batches, pool: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    feats, labels = extract_features(backbone, batches, pool=pool, device=device)
    return feats[max(feats)], labels


def measure(cfg: ControlsConfig, data, device) -> dict[str, Any]:
    """{control: {set: [top-1 per seed]}} for raw pixels and random-init features, linear probe and kNN; the
    random init per ``random_inits`` entry as ``random_linear@<entry>`` / ``random_knn@<entry>`` (the first also
    without suffix)."""
    c, classes = cfg.controls, data.manifest.num_classes
    sets, val = train_sets(data, cfg), list(data.val.batches(cfg.data.batch_size, epoch=0))
    results: dict[str, dict[str, list[float]]] = {k: {} for k in ("pixels_linear", "pixels_knn", "random_linear",
                                                                  "random_knn")}
    test_x, test_y = pixels(val)
    for name, batches in sets.items():
        x, y = pixels(batches)
        results["pixels_knn"][name] = [knn_classify(x, y, test_x, test_y, num_classes=classes, k=c.knn_k)["top1"]]
        results["pixels_linear"][name] = [probe(f"pixels, {name}, seed {s}", x, y, test_x, test_y, seed=s,
                                                num_classes=classes, epochs=c.probe_epochs)["top1"]
                                          for s in c.seeds]
    channels = int(data.manifest.info.get("channels", 1))
    for seed in c.seeds if c.random_init else ():
        for variant in c.random_inits:
            pos_embed, _, pool = variant.rpartition("/")
            backbone = random_init(cfg, seed, channels, pos_embed).to(device)
            te, te_y = features(backbone, val, pool, device)
            for name, batches in sets.items():
                tr, tr_y = features(backbone, batches, pool, device)
                results.setdefault(f"random_knn@{variant}", {}).setdefault(name, []).append(
                    knn_classify(tr, tr_y, te, te_y, num_classes=classes, k=c.knn_k)["top1"])
                results.setdefault(f"random_linear@{variant}", {}).setdefault(name, []).append(
                    probe(f"random init seed {seed} ({variant}), {name}", tr, tr_y, te, te_y, seed=seed,
                          num_classes=classes, epochs=c.probe_epochs)["top1"])
    if c.random_init:
        first = c.random_inits[0]
        results["random_linear"], results["random_knn"] = (results[f"random_linear@{first}"],
                                                           results[f"random_knn@{first}"])
    checkpoints = {path: probe_checkpoint(path, sets, val, c, classes, device) for path in c.checkpoints}
    return {"controls": results, "checkpoints": checkpoints,
            "sets": {name: sum(len(y) for _, y in b) for name, b in sets.items()},
            "test_samples": len(test_y), "test_split": str(cfg.data.val), "preset": cfg.model.preset,
            "pool": c.random_inits[0], "random_inits": list(c.random_inits), "seeds": list(c.seeds),
            "label_subset_seed": cfg.data.label_subset_seed}


def probe_checkpoint(path: str, sets: dict[str, Batches], val: Batches, c: ControlsSection, classes: int,
                     device) -> dict[str, Any]:
    """Linear probe (seed 0) and kNN of one checkpoint's features on every set, on the feature its training
    trained; with the step / epoch its metadata records (a ``run.keep_epochs`` snapshot)."""
    backbone, metadata = load_pretrained(path)
    backbone = backbone.to(device).eval()
    pool = probe_feature_of(metadata, backbone)
    te, te_y = features(backbone, val, pool, device)
    result: dict[str, Any] = {"method": metadata.get("method"), "step": metadata.get("step"),
                              "epoch": metadata.get("epoch"), "pool": pool, "linear": {}, "knn": {}}
    for name, batches in sets.items():
        tr, tr_y = features(backbone, batches, pool, device)
        result["knn"][name] = knn_classify(tr, tr_y, te, te_y, num_classes=classes, k=c.knn_k)["top1"]
        result["linear"][name] = probe(f"{path}, {name}", tr, tr_y, te, te_y, seed=0, num_classes=classes,
                                       epochs=c.probe_epochs)["top1"]
    return result


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def cell(values: list[float] | None) -> str:
    if not values:
        return "-"
    mean, sd = mean_sd(values)
    return f"{mean * 100:.1f}" + (f" ± {sd * 100:.1f}" if len(values) > 1 else "")


# the study's probe keys for each set
STUDY_KEYS = {"probe_set": "linear_probe"}


def learned(method: list[float], control: list[float]) -> str:
    """The study's learned gate on these numbers (``claims.welch_greater``): "learned" where a one-sided Welch
    t-test over >= 3 seeds on each side finds the method above the random-init control at alpha 0.05; fails closed
    (fewer seeds: not learned)."""
    diff = (statistics.mean(method) - statistics.mean(control)) * 100
    p = welch_greater(method, control)
    if p is None:
        return (f"not learned at this budget ({diff:+.1f} pt; {len(method)} / {len(control)} seeds, "
                f"{MIN_SEEDS} needed on each side)")
    return f"{'learned' if p < ALPHA else 'not learned at this budget'} ({diff:+.1f} pt, one-sided Welch p = {p:.2g})"


def report(measured: dict[str, Any], study: dict[str, Any] | None) -> str:
    sets, controls = measured["sets"], measured["controls"]
    names = list(sets)
    heads = [f"{float(n):.0%} of the labels ({sets[n]})" if n != "probe_set" else f"probe set ({sets[n]})"
             for n in names]
    lines = ["# Probe controls", "",
             f"Linear probe (BatchNorm + linear, {measured.get('probe_epochs', '')} AdamW epochs) and kNN (k = 20, "
             f"cosine) top-1 % on {measured['test_samples']} images of the `{measured.get('test_split', 'test')}` "
             "split; mean ± std over seeds "
             f"{measured['seeds']}; random init: `{measured['preset']}`, pooled as each row says (a method is read "
             "against the random init of the feature it probes).", "",
             "| control | " + " | ".join(heads) + " |", "| --- |" + " --- |" * len(names)]
    labels = {"pixels_linear": "raw pixels, linear probe", "pixels_knn": "raw pixels, kNN"}
    for variant in measured.get("random_inits", [measured.get("pool", "mean")]):
        suffix = f"@{variant}" if f"random_linear@{variant}" in controls else ""
        labels |= {f"random_linear{suffix}": f"random-init backbone ({variant}), linear probe",
                   f"random_knn{suffix}": f"random-init backbone ({variant}), kNN"}
    for key, label in labels.items():
        lines.append(f"| {label} | " + " | ".join(cell(controls[key].get(n)) for n in names) + " |")
    if measured.get("checkpoints"):
        lines += ["", "## Checkpoints on the same sets (linear / kNN)", "",
                  "| checkpoint | method | epoch | feature | " + " | ".join(heads) + " |",
                  "| --- | --- | --- | --- |" + " --- |" * len(names)]
        for path, r in measured["checkpoints"].items():
            cells = [f"{r['linear'][n] * 100:.1f} / {r['knn'][n] * 100:.1f}" for n in names]
            lines.append(f"| {path} | {r['method']} | {r['epoch'] if r['epoch'] is not None else '-'} | "
                         f"{r['pool']} | " + " | ".join(cells) + " |")
    if study:
        lines += ["", "## The study's probes against the controls", "",
                  "A method's probe is *learned* where a one-sided Welch t-test over >= 3 seeds on each side finds "
                  "it above the random-init control at alpha 0.05 (the study's learned gate; fewer seeds: not "
                  "learned), else *not learned at this budget*; the raw-pixel probe is shown beside it.", "",
                  "| method | set | method probe | random init (same feature) | raw pixels | verdict |",
                  "| --- | --- | --- | --- | --- | --- |"]
        speech = {r.name for r in RUNS if r.speech}  # other data: no image control applies
        for method, rows in study.items():
            for name in names if method not in speech else ():
                key = STUDY_KEYS.get(name, f"linear_probe@{name}")
                values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
                if not values:
                    continue
                control = controls[random_key(controls, rows)][name]
                lines.append(f"| {method} | {name} | {cell(values)} ({len(values)} seeds) | {cell(control)} | "
                             f"{cell(controls['pixels_linear'][name])} | {learned(values, control)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    study_path, argv = split_study(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg, accelerator, data = start(ControlsConfig, __doc__, argv, augment=False, split_train=False)
        study = json.loads(study_path.read_text())["results"] if study_path else None
        if not accelerator.is_main_process:
            return 0
        measured = {**measure(cfg, data, accelerator.device), "probe_epochs": cfg.controls.probe_epochs}
    except (*USER_ERRORS, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(cfg.run.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "controls.json").write_text(json.dumps(measured, indent=1) + "\n")
    text = report(measured, study)
    (out / "controls.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
