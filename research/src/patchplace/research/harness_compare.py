"""Before -> after table of two reproduction-study results (``study.json``), row by row on the seeds both measured:
what a harness change (e.g. layer decay applied, no weight decay on PEs / tokens, probes of the trained feature, one
Diff. Norm) did to the published numbers.

    python -m patchplace.research.harness_compare results/study_v1/study.json \
        results/study_v1_harness2/study.json --out results/harness_fix.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from patchplace.data.atomic import atomic_file
from patchplace.pipelines.config import HelpFormatter

METRICS = (("top-1", "top1"), ("linear probe", "linear_probe"), ("linear 1%", "linear_probe_1pct"),
           ("kNN (best layer)", "knn"), ("consistency@0.15", "consistency"), ("Diff. Norm@0.15", "diff_norm"))


def mean_on(rows: list[dict], key: str, seeds: list[int]) -> float | None:
    values = [m[key] for m in rows if m["seed"] in seeds and m.get(key) is not None]
    return statistics.mean(values) if len(values) == len(seeds) else None


def compare(before: dict, after: dict) -> list[str]:
    labels = {name: run["label"] for name, run in after.get("runs", {}).items()}
    lines = ["| run | seeds | " + " | ".join(h for h, _ in METRICS) + " |", "|" + " --- |" * (len(METRICS) + 2)]
    for name, rows in after["results"].items():
        old = before["results"].get(name, [])
        seeds = sorted({m["seed"] for m in rows} & {m["seed"] for m in old})
        if not seeds:
            continue
        cells = []
        for _, key in METRICS:
            a, b = mean_on(old, key, seeds), mean_on(rows, key, seeds)
            if a is None or b is None:
                cells.append("-")
            elif key == "diff_norm":
                cells.append(f"{a:.2f} -> {b:.2f}")
            else:
                cells.append(f"{100 * a:.1f} -> {100 * b:.1f} ({100 * (b - a):+.1f})")
        lines.append(f"| {labels.get(name, name)} | {','.join(map(str, seeds))} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("before", type=Path, help="study.json measured before the change")
    parser.add_argument("after", type=Path, help="study.json measured after it")
    parser.add_argument("--out", type=Path, help="write the markdown table here (default: print it)")
    args = parser.parse_args(argv)
    try:
        before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = "\n".join([f"Before ({args.before}, harness {before.get('harness', 1)}) -> after ({args.after}, harness "
                      f"{after.get('harness', 1)}); means over the seeds both measured; accuracies in %.", "",
                      *compare(before, after)]) + "\n"
    if args.out:
        with atomic_file(args.out) as tmp:
            tmp.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
