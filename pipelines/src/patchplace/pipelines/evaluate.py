"""Evaluate a checkpoint with PyTorch: classification, frozen-feature probes and each method's own curves.

    python pipelines/evaluate.py --config pipelines/configs/evaluate_fashion_mnist.yaml \\
        model.checkpoint=runs/x/checkpoint
    # + MJP's gradient inversion (--privacy):
    python pipelines/evaluate.py --privacy --config pipelines/configs/evaluate_fashion_mnist.yaml \\
        model.checkpoint=runs/x/checkpoint privacy.images=10 privacy.steps=200

Reports (``results.json`` + ``report.md`` + PNGs in ``run.output``): top-1 / top-5 / confusion matrix when the
checkpoint has a head; linear probe and layer-wise kNN probe (MP3 App. C) on frozen features; position probe
(DropPos Table 7); MJP consistency and Diff. Norm over the eval jigsaw ratios (MJP Table 1 / Fig. 3) for
classifiers; MP3 position accuracy vs eta (Fig. 3) + a reassembled image (Fig. 2) and the DropPos 4 x 4 position
grid when the checkpoint holds those objectives. ``--privacy`` (= ``privacy.enabled=true``) adds MJP's
gradient-inversion evaluation (Table 5 settings (a) / (b) / (c), APRIL analytic + gradient-matching attacks; MSE,
PSNR, SSIM, FFT2D; ``privacy.png`` of originals vs reconstructions, Fig. 5) on one test image per class.

The probes are streamed (docs/pipelines.md, "Evaluation protocols"): on one process or several (``accelerate launch
--multi_gpu``), each extracts its share of the splits batch by batch into a feature store under
``run.output/features/`` and scores its share of the classification and of the kNN; the linear probes (the papers'
recipes, ``eval.probe_*``: MAE / RandSAC's LARS, StoP / I-JEPA's SGD and last-4-layer concatenation) and the
low-label ones (StoP's logistic regression, ImageNet 1% / 10% lists) train on the main process from the store.
Memory does not grow with the splits, and the results equal one process's.

Refused in one line, before anything is computed: a ``run.output`` holding an earlier evaluation's results (unless
``run.overwrite=true``, which replaces them) or a training run whose lock a live process holds, images the
checkpoint trained on (``data.val`` = its training split, or ``data.val=holdout`` outside the hold-out it records), a
classifier on data whose classes (names, order) are not its own, inputs the model cannot take, a label-subset list
naming samples data.train lacks, a sample twice or one class only, and fewer probe samples than classes. Every split
is normalized with the checkpoint's training statistics; a streamed and an in-memory split give the same results
(``results.json`` records ``data.mode``). A stopped (SIGTERM: one line, exit 143) or failed evaluation leaves no
features behind on any process.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.pipelines.evaluate`, before the imports below load torch:
    # cli answers --help from the torch-free config classes (as for pipelines/evaluate.py, byte for byte) and runs
    # anything else through this module imported by its name
    from patchplace.pipelines import cli

    sys.exit(cli.main("evaluate"))

import contextlib
import json
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from patchplace.data.atomic import atomic_file
from patchplace.data.memory import MemoryReader
from patchplace.data.mfcc import build_frontend
from patchplace.finetune import probe_feature_of
from patchplace.models import load_pretrained
from patchplace.pipelines.commands import EvaluateConfig, expand_flags
from patchplace.pipelines.config import ConfigError, check_path, command_args, load
from patchplace.pipelines.curves import CURVES, FILES
from patchplace.pipelines.engine import USER_ERRORS, Data, Interrupted, report, start
from patchplace.pipelines.engine.protocol import LOCK, RunLock
from patchplace.pipelines.engine.rundir import holds_run
from patchplace.pipelines.evaluate_checks import preflight
from patchplace.pipelines.evaluate_images import image_results
from patchplace.pipelines.evaluate_probes import (
    Stores,
    build_stores,
    frozen_probes,
    position_results,
    shared_classification,
)
from patchplace.pipelines.evaluate_report import plot_evaluation, to_markdown
from patchplace.pipelines.evaluation import Ranks, knn_per_layer
from patchplace.pipelines.help import parser

# what other code reads from here besides main: the registry's curves, the probes the memory benchmark drives
__all__ = ["CURVES", "RESULT_FILES", "Stores", "evaluation", "frozen_probes", "main", "to_markdown"]

# what an evaluation writes in run.output (run.overwrite=true replaces an earlier one's)
RESULT_FILES = ("results.json", "report.md", "evaluation.png", *FILES, "privacy.png", "privacy.npz")


def refuse_earlier_results(cfg: EvaluateConfig) -> None:
    """An evaluation never replaces an earlier one's results silently: run.output holding ``results.json`` /
    ``report.md`` is refused (nothing is touched) unless ``run.overwrite=true``."""
    check_path("run.output", cfg.run.output)  # (a name too long to create: one line, not an OSError)
    out = Path(cfg.run.output)
    found = [name for name in RESULT_FILES[:2] if (out / name).is_file()]
    if not found or cfg.run.overwrite:
        return
    try:
        earlier = f" of {json.loads((out / 'results.json').read_text())['checkpoint']}"
    except (OSError, ValueError, KeyError, TypeError):
        earlier = ""
    raise ConfigError(f"run.output {out} already holds the results of an evaluation{earlier} ({', '.join(found)}): "
                      "choose another run.output, or replace them with run.overwrite=true")


def evaluation(cfg: EvaluateConfig, data: Data, backbone, metadata: dict[str, Any], device,
               ranks: Ranks | None = None) -> dict[str, Any] | None:
    """Every result the config asks for, written to run.output (``results.json``, ``report.md``, the plots) by
    the main process, which returns them (the others return None once their shares are done); raises a user error
    (one line) where a part cannot run."""
    ev, ranks = cfg.eval, ranks or Ranks()
    backbone = backbone.to(device).eval()
    out_dir = Path(cfg.run.output)
    if cfg.run.overwrite and ranks.main:  # an earlier evaluation's files go: none is listed or read as this one's
        for name in RESULT_FILES:
            (out_dir / name).unlink(missing_ok=True)
    results: dict[str, Any] = {"checkpoint": cfg.model.checkpoint, "method": metadata.get("method"),
                               "data": data_record(data)}
    try:
        pool = probe_feature_of(metadata, backbone)  # the feature the checkpoint's training trained (docs/design.md)
    except ValueError as exc:
        raise ConfigError(f"{cfg.model.checkpoint}: {exc}") from None
    try:
        with sigterm_raises():
            shared, stores = shared_results(cfg, data, backbone, pool, device, ranks)
            if not ranks.main:
                return None
            return main_results(cfg, data, backbone, metadata, device, {**results, **shared}, stores, pool)
    finally:  # an evaluation that fails half-way, or is stopped, leaves no features behind either
        remove_features(out_dir / "features", ranks, ev.keep_features)


class EvaluationInterrupted(Interrupted):
    """SIGTERM stopped this process's evaluation (its features removed); a rank's own stop, not agreed."""

    every_rank = False


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM (a user's ``kill``, the launcher ending the other ranks once one failed) raises
    :class:`EvaluationInterrupted` in the main thread, so the ``finally`` clauses run (the features removed); a
    second SIGTERM then acts at once (the previous handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, previous)
        raise EvaluationInterrupted("interrupted by SIGTERM: the evaluation stopped, no results written and its "
                                    "features removed; run it again", 128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_features(folder: Path, ranks: Ranks, keep: bool) -> None:
    """What an evaluation leaves of ``run.output/features`` on this machine: each rank removes its own parts (also
    where run.output is not one folder every machine shares, so nothing but this rank wrote them here); without
    eval.keep_features the main rank removes the stores, and the other ranks the folders their parts left, once
    empty (on a shared run.output, the main rank may still be reading the stores)."""
    for split in ("train", "val"):
        shutil.rmtree(folder / split / f"part-{ranks.rank}", ignore_errors=True)
    if keep:
        return
    if ranks.main:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for empty in (folder / "train", folder / "val", folder):
        with contextlib.suppress(OSError):
            empty.rmdir()


def data_record(data: Data) -> dict[str, str]:
    """What read the splits: ``mode`` ``in_memory`` (data.in_memory) or ``streamed`` (shards read batch by batch),
    ``mixed`` when data.train and data.val differ; every result is the same on either."""
    modes = {split: "in_memory" if isinstance(reader, MemoryReader) else "streamed"
             for split, reader in (("train", data.train), ("val", data.val))}
    return {"mode": modes["val"] if len(set(modes.values())) == 1 else "mixed", **modes}


def shared_results(cfg: EvaluateConfig, data: Data, backbone, pool: str, device, ranks: Ranks
                   ) -> tuple[dict[str, Any], Stores]:
    """What every process computes its share of: classification, the feature stores, the layer-wise kNN."""
    results: dict[str, Any] = {}
    if backbone.config.num_classes == data.manifest.num_classes:
        results["classification"] = shared_classification(backbone, data, cfg.data.batch_size, device, ranks)
    stores = build_stores(cfg, data, backbone, pool, device, ranks)
    results["probe_train_samples"] = len(stores.probe)  # drawn from the whole split, on any number of processes
    if cfg.eval.knn:
        results["knn_per_layer"] = knn_per_layer(stores.train, stores.probe, stores.val, len(backbone.blocks),
                                                 data.manifest.num_classes, ranks, device)
    return results, stores


def main_results(cfg: EvaluateConfig, data: Data, backbone, metadata: dict[str, Any], device,
                 results: dict[str, Any], stores: Stores, pool: str) -> dict[str, Any]:
    """The main process's part: the probes trained from the stores, the position probe, the image results; the
    files written."""
    out_dir = Path(cfg.run.output)
    results["probe_feature"] = pool
    results["probe_pos_embed"] = backbone.config.pos_embed  # with the feature: the random-init control it reads
    results.update(frozen_probes(cfg, stores, data.manifest.num_classes, device))
    if cfg.eval.position_probe:
        results["position_probe"] = position_results(cfg, data, backbone, stores, pool, device)
    results.update(image_results(cfg, data, backbone, metadata, device, out_dir))
    write_results(results, data, out_dir)
    return results


def write_results(results: dict[str, Any], data: Data, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot_evaluation(results, data.manifest.classes, out_dir) + sorted(
        p.name for p in out_dir.glob("*.png") if p.name != "evaluation.png")
    for name, text in (("results.json", json.dumps(results, indent=2) + "\n"), ("report.md", to_markdown(results))):
        with atomic_file(out_dir / name) as tmp:  # a kill never leaves a half-written result
            tmp.write_text(text)


@contextlib.contextmanager
def run_lock(out: Path, main: bool) -> Iterator[None]:
    """A training run's folder (its ``.lock``, log or checkpoints) is evaluated into under its lock (main process):
    refused in one line while a live training process holds it, and held while the evaluation writes, so no run
    resumes there meanwhile; released with the lock file given back what it held (a plain folder gets none)."""
    if not main or not ((out / LOCK).exists() or holds_run(out)):
        yield
        return
    lock = RunLock(out).acquire()
    try:
        yield
    finally:
        lock.release(restore=True)


def ranks_of(accelerator) -> Ranks:
    """The :class:`Ranks` of an Accelerator (sums on its device: NCCL reduces GPU tensors)."""
    return Ranks(accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone,
                 lambda t: accelerator.reduce(t.to(accelerator.device), reduction="sum").cpu())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = expand_flags(argv)  # --privacy: privacy.enabled=true
    try:
        parser(EvaluateConfig, __doc__, argv).parse_args(argv)  # argparse's usage errors
        refuse_earlier_results(load(EvaluateConfig, *command_args(argv)))  # before anything is read
        cfg, accelerator, data = start(EvaluateConfig, __doc__, argv, augment=False, split_train=False)
        backbone, metadata = load_pretrained(cfg.model.checkpoint)
        if data.frontend is not None and metadata.get("frontend"):  # the speech front end the checkpoint trained on
            data.frontend = build_frontend(metadata["frontend"]).to(accelerator.device)
        preflight(cfg, data, backbone, metadata)
        with run_lock(Path(cfg.run.output), accelerator.is_main_process):
            results = evaluation(cfg, data, backbone, metadata, accelerator.device, ranks_of(accelerator))
    except (*USER_ERRORS, EvaluationInterrupted) as exc:  # ConfigError, DataError, ModelError, PrivacyError, ...
        return report(exc)  # one line, exit 2 (SIGTERM: 143); the run.output this launch created goes while empty
    accelerator.end_training()  # every rank, the others as soon as their shares are done (as the trainer's end)
    if results is not None:  # the main process (the others computed their shares)
        print(to_markdown(results))
    return 0
