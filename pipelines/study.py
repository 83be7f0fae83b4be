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

import argparse
import os
import sys
from pathlib import Path

import torch
from config import ConfigError, describe, load
from stages import StageError
from study_plan import StudyConfig
from study_report import report
from study_runner import Study

# The study in modules: study_plan (budget knobs, groups, runs), study_runner (the stages), study_metrics (the
# numbers), study_claims (the verdicts), study_report (tables, figures, results files); this file: the command line.


# relative cost of each group at the default budget (training epochs + evaluations), to balance --jobs
GROUP_COST = {"main": 9.0, "mp3_pe": 3.0, "mp3_eta": 2.0, "droppos": 4.0, "mjp": 2.5, "randsac": 2.5, "speech": 0.5}


def split_groups(groups: tuple[str, ...], jobs: int) -> list[list[str]]:
    """Greedy longest-first split of the groups over ``jobs`` processes; mp3_pe rides with main (it fine-tunes the
    main MP3 pretraining) and comes after it."""
    units = [[g] for g in groups if g != "mp3_pe"]
    if "mp3_pe" in groups:
        host = next((u for u in units if u == ["main"]), None)
        host.append("mp3_pe") if host is not None else units.append(["mp3_pe"])
    buckets: list[list[str]] = [[] for _ in range(min(jobs, len(units)))]
    for unit in sorted(units, key=lambda u: -sum(GROUP_COST[g] for g in u)):
        min(buckets, key=lambda b: sum(GROUP_COST[g] for g in b)).extend(unit)
    return [sorted(b, key=lambda g: (groups.index(g) if g != "mp3_pe" else groups.index("main") + 0.5))
            for b in buckets if b]  # each process keeps the priority order of ``groups``


def run_jobs(args: argparse.Namespace, cfg: StudyConfig) -> int:
    """Run the groups as ``args.jobs`` study processes (each with cpu_count / jobs torch threads); logs in runs/."""
    import subprocess

    threads = cfg.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    base = [sys.executable, __file__, *(["--config", args.config] if args.config else []), *args.overrides]
    logs, procs = [], []
    Path(cfg.runs).mkdir(parents=True, exist_ok=True)
    for i, groups in enumerate(split_groups(cfg.groups, args.jobs)):
        log = Path(cfg.runs) / f"job{i}.log"
        print(f"[study] job {i}: groups {groups}, {threads} thread(s), log {log}", flush=True)
        with log.open("a") as f:
            procs.append(subprocess.Popen([*base, f"groups=[{','.join(groups)}]", f"threads={threads}"],
                                          stdout=f, stderr=subprocess.STDOUT))
        logs.append(log)
    codes = [proc.wait() for proc in procs]
    failed = [str(log) for log, code in zip(logs, codes, strict=True) if code != 0]
    if failed:
        print(f"error: study job(s) failed, see {', '.join(failed)}; run the same command again (it resumes)",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="config fields (override with field=value):\n" + "\n".join(
                                         describe(StudyConfig)))
    parser.add_argument("--config", help="YAML file (pipelines/configs/study_fashion_mnist.yaml)")
    parser.add_argument("--report-only", action="store_true", help="only (re)write the results from finished runs")
    parser.add_argument("--jobs", type=int, default=1, help="study processes sharing the groups (default: 1)")
    parser.add_argument("overrides", nargs="*", help="field=value, e.g. seeds=[0,1,2] groups=[main]")
    args = parser.parse_args(argv)
    try:
        cfg = load(StudyConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if args.jobs > 1 and not args.report_only:
        if run_jobs(args, cfg) != 0:
            return 1
    elif not args.report_only:
        try:
            Study(cfg).run_all()
        except StageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(report(cfg, argv))
    print(f"[study] results: {cfg.results}/{cfg.name}.md, {cfg.name}.json and {cfg.name}_*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
