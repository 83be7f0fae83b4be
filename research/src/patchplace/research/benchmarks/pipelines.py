"""Suites through the pipelines themselves: end-to-end pretrain.py per data path against the pure step
(pipelines), pretrain.py on one process vs two (ddp), and finetune.py's supervised baseline against a plain timm
loop (anchor). pretrain.py and finetune.py run in-process (their ``main``), or as processes for ddp; the pure step
is pretrain.py's training built through its public API (:func:`pure_step_main`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from patchplace.pipelines import CONFIGS
from patchplace.pipelines.config import load
from patchplace.research.benchmarks.common import STUDY

PIPELINE_PATHS = ("pure_step", "memory", "streaming")


class RepeatedBatch:
    """The pipelines suite's "pure step" data source: the first batch of a reader, on the training device, served
    again and again. The training loop (Accelerate, optimizer, schedule, EMA, logging) with the data path taken out,
    so end-to-end samples/s over these samples/s is what the data path costs."""

    def __init__(self, reader: Any, batch_size: int, device: torch.device) -> None:
        self.reader = reader
        first = next(iter(reader.batches(batch_size, epoch=0)))
        self.batch = [t.to(device) if torch.is_tensor(t) else t for t in first]

    def __getattr__(self, name: str) -> Any:  # manifest, transform, skipped, num_batches, ... of the real reader
        return getattr(self.reader, name)

    def __len__(self) -> int:
        return len(self.reader)

    def batches(self, batch_size: int, epoch: int, skip: int = 0):
        for _ in range(skip, self.reader.num_batches(batch_size)):
            yield self.batch


def pure_step_main(argv: list[str]) -> int:
    """pretrain.py's training with the data path taken out: its config, objective and :class:`Trainer`, built as
    ``pretrain.main`` builds them (``start``, ``build_objective``: the pipelines' public API), fed a
    :class:`RepeatedBatch` of the train reader (streamed without workers, so that it starts at once); the log names
    the train path ``pure_step``. No validation. -> exit code, as a pipeline's ``main``."""
    from patchplace.pipelines import pretrain
    from patchplace.pipelines.engine import USER_ERRORS, Trainer, report, start

    try:
        cfg, accelerator, data = start(pretrain.PretrainConfig, pretrain.__doc__, argv)
        data = dataclasses.replace(data, train=RepeatedBatch(data.train, cfg.data.batch_size, accelerator.device),
                                   path={**data.path, "train": "pure_step"})
        m = data.manifest
        objective, backbone = pretrain.build_objective(cfg, m.num_classes, int(m.info.get("channels", 1)),
                                                       m.modality, data)
        trainer = Trainer(accelerator, objective, backbone, data, cfg.optim, cfg.run, config=cfg,
                          metadata={"method": cfg.method, "objective": cfg.objective_values()},
                          command="pure step")
    except USER_ERRORS as exc:
        return report(exc)
    return trainer.train(cfg.data.batch_size)[1]


def pipelines_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """End-to-end samples/s of the Fashion-MNIST pretraining configs through pretrain.py, per data path: in memory
    (batched augmentation on the training device), streaming (shards + DataLoader workers + timm's per-sample
    transform), and the same training loop fed one repeated on-device batch (pure step). ``end_to_end_ratio`` =
    a path's samples/s / the pure step's, from the same run; the three are alternated ``--pipelines-repeats`` times
    and medians reported. Rates exclude startup (reading the split, spawning workers, the first step: logged as
    startup_s, reported apart)."""
    import statistics

    from patchplace.pipelines import pretrain

    if not (args.shards / "manifest.json").is_file():
        print(f"pipelines: no shards at {args.shards}: skipped", flush=True)
        return []
    configs = CONFIGS
    val = args.shards.parent / "test" if (args.shards.parent / "test" / "manifest.json").is_file() else args.shards
    methods = args.methods or ["supervised", "mp3", "droppos", "mae"]
    preset = args.pipelines_preset
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.pipelines_repeats):
        for method in methods:
            for path in PIPELINE_PATHS:
                overrides = [f"data.train={args.shards}", f"data.val={val}", f"optim.max_steps={args.steps}",
                             f"data.batch_size={args.pipelines_batch}", "run.tensorboard=false",
                             f"run.log_every={args.steps}", "run.checkpoint_every=0",
                             f"data.in_memory={'true' if path == 'memory' else 'false'}",
                             f"data.num_workers={0 if path == 'pure_step' else args.pipelines_workers}",
                             *([f"model.preset={preset}"] if preset else []), *args.pipelines_overrides]
                run = pure_step_main if path == "pure_step" else pretrain.main
                with tempfile.TemporaryDirectory() as tmp:
                    if run(["--config", str(configs / f"{method}_fashion_mnist.yaml"), f"run.output={tmp}",
                            *overrides]) != 0:
                        raise SystemExit(f"pipelines: {method} ({path}) failed")
                    last = [r for r in map(json.loads, (Path(tmp) / "log.jsonl").read_text().splitlines())
                            if "loss" in r][-1]  # the last training step (pretraining then logs its validation)
                assert last["data"]["train"] == path, last["data"]
                runs.setdefault((method, path), []).append(last)
                print(json.dumps({"method": method, "path": path, "samples_per_s": last["samples_per_s"],
                                  "startup_s": last["startup_s"], "data_share": last["data_share"]}), flush=True)
    rows = []
    for method in methods:
        pure = statistics.median(r["samples_per_s"] for r in runs[(method, "pure_step")])
        for path in PIPELINE_PATHS:
            logs = runs[(method, path)]
            rate = statistics.median(r["samples_per_s"] for r in logs)
            rows.append({"name": f"train/{method}", "path": path, "samples_per_s": round(rate, 1),
                         "runs": [r["samples_per_s"] for r in logs],
                         "end_to_end_ratio": round(rate / pure, 3),
                         "startup_s": round(statistics.median(r["startup_s"] for r in logs), 1),
                         "data_share": round(statistics.median(r["data_share"] for r in logs), 4),
                         "steps": args.steps, "batch": args.pipelines_batch,
                         "num_workers": args.pipelines_workers if path == "streaming" else 0,
                         "preset": preset or "config's", "threads": torch.get_num_threads(), "suite": "pipelines"})
    return rows


ANCHOR_RECIPE = ["finetune.mixup=0.0", "finetune.cutmix=0.0", "optim.layer_decay=null", "data.scale=[0.8, 1.0]"]


def _plain_timm_loop(cfg: Any, epochs: float, seed: int) -> dict[str, Any]:
    """A plain timm training loop: timm's VisionTransformer built from the preset's config, timm's AdamW (no weight
    decay on biases / norms) and label-smoothing loss, linear warm-up + cosine, fed the same in-memory split and
    batched augmentation as ours. -> test top-1 and training samples/s."""
    import math

    from timm.loss import LabelSmoothingCrossEntropy
    from timm.models.vision_transformer import VisionTransformer
    from timm.optim import create_optimizer_v2

    from patchplace.data.batched import build_batched_transform
    from patchplace.data.memory import InMemorySplit, MemoryReader
    from patchplace.models import create_model
    from patchplace.models.timm_interop import timm_kwargs

    torch.manual_seed(seed)
    d, o, f = cfg.data, cfg.optim, cfg.finetune
    train_split, test_split = InMemorySplit.load(d.train, num_workers=d.num_workers), InMemorySplit.load(d.val)
    options = dict(pad_to=d.pad_to, img_size=d.img_size, scale=d.scale, hflip=d.hflip, re_prob=d.re_prob)
    train = MemoryReader(train_split, build_batched_transform(train_split.manifest, True, **options), seed=seed)
    test = MemoryReader(test_split, build_batched_transform(test_split.manifest, False, pad_to=d.pad_to,
                                                           img_size=d.img_size), shuffle=False)
    config = create_model(cfg.model.preset, in_chans=int(train_split.manifest.info.get("channels", 1)),
                          num_classes=train_split.manifest.num_classes).config
    model = VisionTransformer(**timm_kwargs(config), drop_path_rate=f.drop_path)
    optimizer = create_optimizer_v2(model, "adamw", lr=o.lr, weight_decay=o.weight_decay, betas=o.betas)
    per_epoch = train.num_batches(d.batch_size)
    total = max(1, round(epochs * per_epoch))
    warmup = round(o.warmup_fraction * total)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else (
        o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))))
    criterion = LabelSmoothingCrossEntropy(f.label_smoothing)
    step, start, epoch = 0, time.perf_counter(), 0
    model.train()
    while step < total:
        for x, y in train.batches(d.batch_size, epoch):
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if o.clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
            optimizer.step()
            schedule.step()
            step += 1
            if step >= total:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in test.batches(256, epoch=0):
            correct += int((model(x).argmax(1) == y).sum())
    return {"top1": correct / len(test), "samples_per_s": round(total * d.batch_size / seconds, 1), "steps": total}


def anchor_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The supervised baseline (finetune.py from scratch: Accelerate, our backbone, parameter groups, schedule,
    checkpoints, evaluation) against a plain timm ViT loop of the same size on the same data, epochs and recipe
    (:func:`_plain_timm_loop`), per --anchor-seeds. Ours must be at least as accurate."""
    from patchplace.pipelines import finetune

    if not (args.shards / "manifest.json").is_file():
        print(f"anchor: no shards at {args.shards}: skipped", flush=True)
        return []
    val = args.shards.parent / "test" if (args.shards.parent / "test" / "manifest.json").is_file() else args.shards
    config = str(CONFIGS / "finetune_fashion_mnist.yaml")
    preset, batch = args.pipelines_preset or STUDY["preset"], args.pipelines_batch
    rows = []
    for seed in args.anchor_seeds:
        overrides = [f"data.train={args.shards}", f"data.val={val}", f"model.preset={preset}",
                     f"optim.epochs={args.anchor_epochs}", f"data.batch_size={batch}",
                     f"run.seed={seed}", "run.tensorboard=false", "run.checkpoint_every=0", *ANCHOR_RECIPE,
                     *args.pipelines_overrides]
        with tempfile.TemporaryDirectory() as tmp:
            if finetune.main(["--config", config, f"run.output={tmp}", *overrides]) != 0:
                raise SystemExit("anchor: finetune.py failed")
            log = [json.loads(line) for line in (Path(tmp) / "log.jsonl").read_text().splitlines()]
            cfg = load(finetune.FinetuneConfig, config, overrides)
        ours = {"top1": [r for r in log if "eval" in r][-1]["eval"]["top1"],
                "samples_per_s": [r for r in log if "samples_per_s" in r][-1]["samples_per_s"]}
        plain = _plain_timm_loop(cfg, args.anchor_epochs, seed)
        for name, result in (("patchplace supervised (finetune.py)", ours), ("plain timm loop", plain)):
            rows.append({"name": f"anchor/{name}", "top1": round(result["top1"], 4),
                         "samples_per_s": result["samples_per_s"], "epochs": args.anchor_epochs, "seed": seed,
                         "preset": preset, "batch": batch, "suite": "anchor"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


DDP_SETTINGS = (("1 process", 1, None), ("2 processes", 2, False), ("2 processes, find_unused", 2, True))
# MJP with the jigsaw on every step (its step is one static graph either way: DDP needs no find_unused_parameters)
MJP_EVERY_STEP = ["objective.apply_prob=1.0", "objective.warmup_fraction=0.0"]


def _pretrain_command(processes: int) -> tuple[list[str], dict[str, str]]:
    """The README's commands: plain python for one process, ``accelerate launch --multi_gpu`` (gloo on CPU) for
    more; the cores are shared out between the processes."""
    script = ["-m", "patchplace.pipelines.pretrain"]
    threads = max(1, (os.cpu_count() or 1) // processes)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if processes == 1:
        return [sys.executable, *script], env
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    return [accelerate, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", *script], \
        {**env, "ACCELERATE_USE_CPU": "true"}


def ddp_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Samples/s of pretrain.py with one process vs two (gloo, same global batch, the cores split between them),
    and what DDP's ``find_unused_parameters`` costs: two processes with it off vs on, same run, alternated
    ``--ddp-repeats`` times (medians). MJP runs its jigsaw on every step here, so that it can run with it off."""
    import statistics

    if not (args.shards / "manifest.json").is_file():
        print(f"ddp: no shards at {args.shards}: skipped", flush=True)
        return []
    preset = args.pipelines_preset or STUDY["preset"]
    batch = args.pipelines_batch or STUDY["batch"]
    configs = CONFIGS
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.ddp_repeats):
        for method in args.methods or ["supervised", "mp3", "mjp"]:
            for label, processes, find_unused in DDP_SETTINGS:
                command, env = _pretrain_command(processes)
                with tempfile.TemporaryDirectory() as tmp:
                    overrides = [f"data.train={args.shards}", f"model.preset={preset}",
                                 f"data.batch_size={batch // processes}", f"optim.max_steps={args.steps}",
                                 "data.num_workers=0", "run.tensorboard=false", f"run.log_every={args.steps}",
                                 f"run.output={tmp}", *(MJP_EVERY_STEP if method == "mjp" else []),
                                 *([f"run.find_unused_parameters={str(find_unused).lower()}"]
                                   if find_unused is not None else [])]
                    done = subprocess.run([*command, "--config", str(configs / f"{method}_fashion_mnist.yaml"),
                                           *overrides], env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise SystemExit(f"ddp: {method} ({label}) failed:\n{done.stderr[-3000:]}")
                    last = [r for r in map(json.loads, (Path(tmp) / "log.jsonl").read_text().splitlines())
                            if "loss" in r][-1]  # the last training step
                assert last["world_size"] == processes
                rates.setdefault((method, label), []).append(last["samples_per_s"])
                print(json.dumps({"method": method, "setting": label, "samples_per_s": last["samples_per_s"]}),
                      flush=True)
    rows = []
    for (method, label), values in rates.items():
        rows.append({"name": f"ddp/{method}", "ddp_setting": label,
                     "samples_per_s": round(statistics.median(values), 1), "runs": values, "global_batch": batch,
                     "steps": args.steps, "preset": preset, "suite": "ddp"})
    for row in rows:
        one = rates[(row["name"][4:], DDP_SETTINGS[0][0])]
        off = rates[(row["name"][4:], DDP_SETTINGS[1][0])]
        row["vs_one_process"] = round(row["samples_per_s"] / statistics.median(one), 3)
        if row["ddp_setting"] == DDP_SETTINGS[2][0]:
            row["vs_find_unused_off"] = round(row["samples_per_s"] / statistics.median(off), 3)
    return rows
