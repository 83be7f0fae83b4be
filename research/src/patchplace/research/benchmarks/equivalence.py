"""Does bf16 training train the same as float32? (cpu_equivalence): the test a faster precision passes before
``run.mixed_precision=auto`` adopts it (:mod:`patchplace.pipelines.engine.hardware`).

For each of --equivalence-methods and --equivalence-seeds, the study's own stages (its defaults, ``StudyConfig``:
its ViT, budget, recipe and held-out validation split) train twice, in float32 and under bf16 autocast, from the
same seed: pretraining, then the two numbers compared, both on the **validation** split (the test split is not
read): the 1% linear probe of the pretrained backbone and the top-1 of its fine-tune. Each precision pair is
seed-paired and decided by a TOST at alpha 0.05 against a margin of +-1 pt stated before the runs: equivalent when
the 90% CI of the mean bf16 - float32 difference lies inside the margin.

On a CPU without bf16 units the bf16 runs use :mod:`patchplace.research.emulated_bf16` (the same roundings, at
float32 speed: a native bf16 step is ~15x slower there); with bf16 units they run natively. The runs live below
--equivalence-runs/<precision>/ and resume as the study's do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchplace.pipelines import CONFIGS
from patchplace.pipelines.config import load
from patchplace.pipelines.engine.hardware import cpu_info
from patchplace.pipelines.stages import as_process, by_precision, stage
from patchplace.research.reproduction.claims import ALPHA, paired_test
from patchplace.research.reproduction.plan import RUNS, StudyConfig
from patchplace.research.reproduction.runner import EVALUATE, Study, controls, evaluate

MARGIN = 0.01  # +-1 pt of top-1, stated before the runs (the study's on-par margin)
PRECISIONS = ("fp32", "bf16")
MEASURES = {"probe_1pct": "1% linear probe (validation)", "finetune_top1": "fine-tuned top-1 (validation)"}


def bf16_training(pipeline: str) -> Callable[[list[str]], int]:
    """How a bf16 training stage runs: pretrain.py / finetune.py with ``run.mixed_precision=bf16``, natively where
    the CPU has bf16 units, else under :mod:`patchplace.research.emulated_bf16` (each its own process)."""
    if cpu_info().onednn_bf16:
        run = by_precision(f"patchplace.pipelines.{pipeline}")
        return lambda argv: run([*argv, "run.mixed_precision=bf16"])
    emulated = as_process("patchplace.research.emulated_bf16")
    return lambda argv: emulated([pipeline, *argv, "run.mixed_precision=bf16"])


def study(args: argparse.Namespace, precision: str) -> Study:
    """The study's defaults (+ --equivalence-study) with the --equivalence-finetune rows fine-tuned (the
    others probed only), its runs below <runs>/<precision>/; bf16: its training stages in bf16
    (:func:`bf16_training`), its evaluations in float32."""
    cfg = load(StudyConfig, None, list(args.equivalence_study))
    finetuned = tuple(args.equivalence_finetune if args.equivalence_finetune is not None else
                      args.equivalence_methods)
    cfg = dataclasses.replace(cfg, runs=str(Path(args.equivalence_runs) / precision),
                              full_label_rows=finetuned or ("supervised",), first_seed_finetunes=False)
    train_with = {p: bf16_training(p) for p in ("pretrain", "finetune")} if precision == "bf16" else None
    return Study(cfg, train_with=train_with)


def measure(s: Study, method: str, seed: int) -> dict[str, float]:
    """Pretrain (+ fine-tune, for the study's full-label rows) ``method`` (seed ``seed``) as the study does, then its
    validation numbers."""
    c, run = s.cfg, next(r for r in RUNS if r.name == method)
    backbone, classifier, _ = s.train(run, seed)
    d = s.dir(run, seed)
    stage(d / "probe_val", controls, [
        "--config", str(CONFIGS / "controls_fashion_mnist.yaml"), f"run.output={d / 'probe_val'}",
        f"controls.seeds=[{seed}]", f"model.preset={c.preset}", "controls.random_init=false",
        "controls.label_fractions=[0.01]", "controls.probe_train_samples=0", f"controls.probe_epochs={c.probe_epochs}",
        f"controls.checkpoints=[{backbone}]", f"data.label_subset_seed={c.label_subset_seed}", *s.data(run),
        f"data.val_limit={c.holdout}"], label=f"{d} probe_val")
    probe = json.loads((d / "probe_val" / "controls.json").read_text())["checkpoints"]
    found = {"probe_1pct": next(iter(probe.values()))["linear"]["0.01"]}
    if classifier is not None:
        stage(d / "val", evaluate, [
            *EVALUATE, f"run.output={d / 'val'}", f"model.checkpoint={classifier}", "eval.linear_probe=false",
            "eval.knn=false", "eval.position_probe=false", "eval.consistency_ratios=[]", "eval.max_eval_samples=16",
            *s.data(run), f"data.val_limit={c.holdout}"], label=f"{d} val")
        found["finetune_top1"] = json.loads((d / "val" / "results.json").read_text())["classification"]["top1"]
    return found


def tost(bf16: dict[int, float], fp32: dict[int, float]) -> dict[str, Any]:
    """Seed-paired TOST of bf16 - float32 at :data:`ALPHA` against +-:data:`MARGIN`."""
    test = paired_test(bf16, fp32)
    assert test is not None and test.p is not None, "the TOST needs two or more shared seeds"
    low, high = test.interval(1 - 2 * ALPHA)
    return {"mean_diff": round(test.mean, 5), "ci90": [round(low, 5), round(high, 5)],
            "ci95": [round(test.low, 5), round(test.high, 5)], "p_difference": round(test.p, 4),
            "margin": MARGIN, "equivalent": bool(low > -MARGIN and high < MARGIN), "seeds": test.seeds}


def equivalence_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Per method and measure: both precisions' per-seed values, their TOST; a last row: whether every test
    passed (the verdict ``auto`` reads)."""
    cpu = cpu_info()
    state["cpu"] = {"name": cpu.name, "flags": list(cpu.flags), "bf16_units": cpu.bf16_units,
                    "onednn_bf16": cpu.onednn_bf16}
    precisions = args.equivalence_precisions or list(PRECISIONS)
    studies = {p: study(args, p) for p in precisions}
    shards = Path(studies[precisions[0]].cfg.fashion_mnist) / "train"
    if not (shards / "manifest.json").is_file():
        print(f"cpu_equivalence: no shards at {shards}: skipped", flush=True)
        return []
    values: dict[tuple[str, str, str], dict[int, float]] = {}
    for method in args.equivalence_methods:
        for seed in args.equivalence_seeds:
            for precision in precisions:
                found = measure(studies[precision], method, seed)
                for key, value in found.items():
                    values.setdefault((method, key, precision), {})[seed] = value
                print(json.dumps({"method": method, "seed": seed, "precision": precision, **found}), flush=True)
    if len(precisions) < len(PRECISIONS):  # one side only (e.g. the two precisions in two processes): no test yet
        return []
    rows = []
    for method in args.equivalence_methods:
        for key, label in MEASURES.items():
            if (method, key, "fp32") not in values:
                continue
            fp32, bf16 = values[(method, key, "fp32")], values[(method, key, "bf16")]
            rows.append({"suite": "cpu_equivalence", "name": f"equivalence/{method}", "measure": label,
                         "fp32": {s: round(v, 4) for s, v in fp32.items()},
                         "bf16": {s: round(v, 4) for s, v in bf16.items()}, **tost(bf16, fp32),
                         "bf16_kernels": "native" if cpu.onednn_bf16 else "emulated (float32 accumulation)"})
            print(json.dumps(rows[-1]), flush=True)
    state["equivalent"] = all(r["equivalent"] for r in rows)
    return rows
