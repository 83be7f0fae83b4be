"""Reproduction study: the rows a pre-registered protocol reads, trained and measured on the same data, backbone
and budget; its report (JSON, markdown) goes to ``results/``.

    make study                                                         # = the line below
    python pipelines/study.py --jobs 2 --config pipelines/configs/study_v5.yaml
    python pipelines/study.py --config pipelines/configs/study_v5.yaml --report-only

Fashion-MNIST padded to 32 x 32 (patch ``patch_size``), one small ViT (``preset``) for all methods. Per row: its
pretraining (or, for the supervised and MJP classifiers, training from scratch to convergence on validation),
the learned gate on validation, linear probes, the MP3 eta curve / DropPos grid (validation and test), and a
classifier's top-1 on the test split, read once.

Groups (``groups=[...]``): main (supervised, MJP and every method's main row), mp3_eta (MP3 Fig. 3), droppos
(DropPos Table 3), speech (MP3 Table 5).

Resumable: every stage of every run leaves ``DONE`` and a killed run resumes from its last checkpoint; two study
processes may run different units at once (a stage being run by one is refused to the other). The budget knobs are
all in the config (:class:`~patchplace.research.reproduction.plan.StudyConfig`).
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
from dataclasses import dataclass
from pathlib import Path

import torch

from patchplace.pipelines.config import ConfigError, load
from patchplace.pipelines.engine.hardware import precision_line, resolve_precision
from patchplace.pipelines.stages import StageError
from patchplace.research.cli import study_parser
from patchplace.research.reproduction.plan import StudyConfig, group_seeds, run_seeds, runs_of
from patchplace.research.reproduction.protocol import ProtocolError, load_protocol
from patchplace.research.reproduction.report import report
from patchplace.research.reproduction.runner import Study
from patchplace.research.reproduction.schedule import run_protocol, with_decisions

__all__ = ["Unit", "main", "row_units", "run_jobs", "seeds_of_group", "study_units"]

# The study in modules (reproduction/): plan (budget knobs, groups, runs), runner (the stages), metrics (the
# numbers), claims (the verdicts), report (tables, figures, results files); this file: the command line and the
# units its --jobs processes share.


@dataclass(frozen=True)
class Unit:
    """What one study process of ``--jobs`` runs: a group on one seed, or with ``unit_per_row`` one row (``only``:
    the unit's row). In the config's priority order."""

    groups: tuple[str, ...]
    seed: int
    only: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{'+'.join(self.groups)}{' ' + ','.join(self.only) if self.only else ''} seed {self.seed}"

    def overrides(self) -> list[str]:
        return [f"groups=[{','.join(self.groups)}]", f"only_seeds=[{self.seed}]",
                *([f"only=[{','.join(self.only)}]"] if self.only else [])]


def study_units(cfg: StudyConfig) -> list[Unit]:
    """Every (group, seed) unit once, in the priority order of ``cfg.groups``, then by seed; ``unit_per_row``:
    every (row, seed) instead (:func:`row_units`)."""
    if cfg.unit_per_row:
        return row_units(cfg)
    return [Unit((group,), seed) for group in cfg.groups for seed in seeds_of_group(cfg, group)]


def seeds_of_group(cfg: StudyConfig, group: str) -> list[int]:
    """Every seed a row of ``group`` runs (its group's seeds and the ``close_seeds`` of its close rows), ascending."""
    return sorted({*group_seeds(cfg, group), *(s for run in runs_of((group,), cfg.only, cfg.skip)
                                                for s in run_seeds(cfg, run))})


def row_units(cfg: StudyConfig) -> list[Unit]:
    """One unit per (row, seed) of the groups (``only`` / ``skip`` applied), in the order of the groups, then the
    seed, then the group's rows."""
    return [Unit((group,), seed, (run.name,)) for group in cfg.groups for seed in seeds_of_group(cfg, group)
            for run in runs_of((group,), cfg.only, cfg.skip) if seed in run_seeds(cfg, run)]


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
    if not cfg.protocol and args.report_only:
        print(f"error: {args.config or 'the config'} names no protocol: the study reports its claims only under a "
              "pre-registered one (protocol: research/protocols/..., as pipelines/configs/study_v5.yaml)",
              file=sys.stderr)
        return 2
    if not cfg.protocol and not args.no_report:
        print("[study] no protocol in the config: its stages run and no report is written (claims are decided "
              "only under a pre-registered protocol: pipelines/configs/study_v5.yaml)", flush=True)
        args.no_report = True
    if not args.report_only:
        print(f"[study] {precision_line(resolve_precision(cfg.precision))}" if cfg.precision == "auto" else
              f"[study] precision={cfg.precision} (forced)", flush=True)
    # the protocol's order (schedule.py); a process given its unit's only_seeds (a job's unit) runs just that
    # unit's stages
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
            Study(cfg).run_all()
        except StageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.no_report:
        return 0
    print(report(cfg, argv))
    print(f"[study] results: {cfg.results}/{cfg.name}.md and {cfg.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
