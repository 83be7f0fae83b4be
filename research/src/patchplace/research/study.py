"""Reproduction study: every method on the same data, backbone and budget, then the ablations that carry each
paper's claim, in miniature; results (JSON, markdown tables, PNGs) go to ``results/``.

    make study                                                         # = the line below
    python pipelines/study.py --config pipelines/configs/study_fashion_mnist.yaml
    python pipelines/study.py --config pipelines/configs/study_fashion_mnist.yaml groups=[main] seeds=[0,1,2]
    python pipelines/study.py --config pipelines/configs/study_fashion_mnist.yaml --report-only

Fashion-MNIST padded to 32 x 32, patch 4 (64 positions, the MP3 CIFAR setting), one small ViT (``preset``) for all
methods. Each pretraining method is followed by the same fine-tuning recipe (``finetune_fashion_mnist.yaml`` +
``finetune_overrides``); the supervised baseline and MJP (a supervised recipe) train from scratch for the same
*total* epochs. Per run: PyTorch evaluation (top-1, MJP consistency / Diff. Norm over eval gamma), probes of the
backbone (linear at 100% and 1% of the labels, kNN per layer, position probe, MP3 eta curve, DropPos grid), and for
the main table the ONNX export + ONNX Runtime evaluation (top-1, corruption errors -> mCE vs the supervised run).

Groups (``groups=[...]``): main, mp3_pe (MP3 Table 3), mp3_eta (Figs. 3 and 6), droppos (Tables 1, 3, 4), mjp
(Table 3, Fig. 3), randsac (Tables 2, 5, 7), speech (MP3 Table 5). StoP vs I-JEPA (Tables 1, 6) is in main.

Resumable: every stage of every run leaves ``DONE`` and a killed run resumes from its last checkpoint; two study
processes may run different groups at once (a stage being run by one is refused to the other). The budget knobs are
all in the config (epochs, seeds, probe sizes, threads); the defaults finish on a 2-core CPU in the time stated in
``study_fashion_mnist.yaml``, and scale up by config on a GPU.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.research.study`, before the imports below load torch: the
    # arguments parse without it (--help, a usage error), then this module runs imported by its name
    from patchplace.research import cli

    sys.exit(cli.main("study"))

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch

from patchplace.pipelines.config import ConfigError, load
from patchplace.pipelines.engine.hardware import precision_line, resolve_precision
from patchplace.pipelines.stages import StageError
from patchplace.research.cli import study_parser
from patchplace.research.reproduction.plan import StudyConfig
from patchplace.research.reproduction.protocol import ProtocolError, load_protocol
from patchplace.research.reproduction.report import report
from patchplace.research.reproduction.runner import Study
from patchplace.research.reproduction.schedule import run_protocol, with_decisions
from patchplace.research.reproduction.units import Unit, reused, row_units, seeds_of_group, study_units, with_curves

__all__ = ["Unit", "main", "reused", "row_units", "run_jobs", "seeds_of_group", "study_units", "with_curves"]

# The study in modules (reproduction/): plan (budget knobs, groups, runs), runner (the stages), metrics (the
# numbers), claims (the verdicts), report (tables, figures, results files); this file: the command line.


def run_jobs(args: argparse.Namespace, cfg: StudyConfig, call: Callable[..., int] | None = None) -> int:
    """Run the study as ``args.jobs`` processes at a time (each with cpu_count / jobs torch threads). The units
    wait in one queue in priority order and a process takes the next one when it finishes its last, so finished
    stages (a resumed study) and uneven units never leave a core idle; logs in runs/job<i>.log."""
    import subprocess
    import threading

    call = call or subprocess.call
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    base = [sys.executable, __file__, *(["--config", args.config] if args.config else []), *args.overrides]
    Path(cfg.runs).mkdir(parents=True, exist_ok=True)
    queue, lock, failed = list(study_units(cfg)), threading.Lock(), []
    print(f"[study] {len(queue)} units ({', '.join(map(str, queue))}) over {args.jobs} processes, {threads} "
          f"thread(s) each; logs {Path(cfg.runs) / 'job<i>.log'}", flush=True)

    def job(i: int) -> None:
        log = Path(cfg.runs) / f"job{i}.log"
        while True:
            with lock:
                if not queue or failed:
                    return
                unit = queue.pop(0)
            print(f"[study] job {i}: {unit}", flush=True)
            with log.open("a") as f:
                code = call([*base, *unit.overrides(), f"threads={threads}", "--no-report"], stdout=f,
                            stderr=subprocess.STDOUT)
            if code != 0:
                with lock:
                    failed.append(f"{log} ({unit})")
                return

    workers = [threading.Thread(target=job, args=(i,)) for i in range(max(1, args.jobs))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failed:
        print(f"error: study job(s) failed, see {', '.join(failed)}; run the same command again (it resumes)",
              file=sys.stderr)
        return 1
    return 0


def sittings_main(args: argparse.Namespace, cfg: StudyConfig) -> int:
    """--sitting: the pending units that fit, a bundle each; --merge: the report of every bundle. A file in --bundles
    that is not a whole bundle of this config at its budget is one line (``reproduction.sittings``) and its unit
    pending: measured again by a sitting, listed by --merge."""
    import tempfile
    from dataclasses import replace

    from patchplace.data.atomic import write_json_atomic
    from patchplace.research.reproduction.sittings import merged_study, pending_units, run_sitting, unit_id

    if not args.bundles:
        print("error: --sitting / --merge need --bundles DIR (where the sittings' bundles are kept)", file=sys.stderr)
        return 2
    from patchplace.research.reproduction.waves import with_sizing

    cfg = with_sizing(cfg, Path(args.bundles))  # the GPU waves' epochs, where they sized them
    bundles, units = Path(args.bundles), study_units(cfg)
    merge_only = args.merge and args.sitting is None
    if (bundles.exists() and not bundles.is_dir()) or (merge_only and not bundles.is_dir()):
        print(f"error: --bundles {bundles} is {'a file' if bundles.exists() else 'not there'}: give the directory "
              "the sittings' bundles are kept in", file=sys.stderr)
        return 2
    if args.sitting is not None:
        command = [sys.executable, __file__, *(["--config", args.config] if args.config else []), *args.overrides]
        run_sitting(cfg, units, command, bundles, args.sitting, Path(args.bundles_out) if args.bundles_out else None,
                    args.max_units)
    if args.merge:
        ids = [unit_id(u.groups, u.seed, u.only) for u in units]
        write_json_atomic(Path(cfg.results) / f"{cfg.name}.json", merged_study(cfg, bundles, ids))
        with tempfile.TemporaryDirectory() as empty:  # every row from the bundles, none from a runs/ here
            report(replace(cfg, runs=empty), ["--report-only"])
        pending = pending_units(units, bundles, cfg)
        print(f"[study] {cfg.results}/{cfg.name}.md from {len(units) - len(pending)} of {len(units)} units; pending: "
              f"{', '.join(pending) or 'none'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = study_parser(argv).parse_args(argv)  # (research/cli.py: the options, --help without torch)
    try:
        cfg = load(StudyConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.protocol:  # a pre-registered protocol: its recorded decisions set the epochs every part reads
        try:
            load_protocol(cfg.protocol)
            cfg = with_decisions(cfg)
        except ProtocolError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if not args.report_only and not args.merge:
        print(f"[study] {precision_line(resolve_precision(cfg.precision))}" if cfg.precision == "auto" else
              f"[study] precision={cfg.precision} (forced)", flush=True)
    if args.sitting is not None or args.merge:
        return sittings_main(args, cfg)
    # the protocol's order (schedule.py); a process given its unit's only_seeds (a job, a sitting's unit) runs just
    # that unit's stages
    if cfg.protocol and not args.report_only and not args.no_report and not cfg.only_seeds:
        code = run_protocol(args, cfg, run_jobs)
        if code != 0:
            return code
        cfg = with_decisions(cfg)
        print(report(cfg, argv))
        print(f"[study] results: {cfg.results}/{cfg.name}.md and {cfg.name}.json")
        return 0
    if args.jobs > 1 and not args.report_only:
        if run_jobs(args, cfg) != 0:
            return 1
    elif not args.report_only:
        try:
            Study(cfg).run_all(reused(cfg))
        except StageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.no_report:
        return 0
    print(report(cfg, argv))
    print(f"[study] results: {cfg.results}/{cfg.name}.md, {cfg.name}.json and {cfg.name}_*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
