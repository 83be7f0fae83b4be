"""Research that reads in one screen per part: no function in research/ over 80 lines; the papers' claims are a
table of specs (``claims.PAPER_CLAIMS``) built in one loop, each naming rows, measures and regime checks that
exist; the benchmark's command line is one function per option group."""

from __future__ import annotations

import ast
from pathlib import Path

from patchplace.research import benchmark

RESEARCH = Path(__file__).resolve().parents[1] / "research" / "src"
MAX_LINES = 80


def test_no_function_in_research_is_over_80_lines():
    long = []
    for path in sorted(RESEARCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(RESEARCH)}::{node.name} ({lines} lines)")
    assert list(RESEARCH.rglob("*.py")), "the research sources moved: update RESEARCH"
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_the_benchmark_options_are_one_function_per_group_in_help_order():
    parser = benchmark.build_parser()
    titles = [g.title for g in parser._action_groups][2:]  # after argparse's positionals / options
    assert len(titles) == len(benchmark.OPTION_GROUPS) == len(set(titles))
    assert titles[:2] == ["matmul", "objectives (and models)"] and titles[-1] == "cpu_equivalence"
