"""Research that reads in one screen per part: no function in research/ over 80 lines; the papers' claims are a
table of specs (``claims.PAPER_CLAIMS``) built in one loop, each naming rows, measures and regime checks that
exist; the benchmark's command line is one function per option group."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from patchplace.research import benchmark
from patchplace.research.reproduction import claims
from patchplace.research.reproduction.plan import RUNS

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


@pytest.mark.parametrize("spec", claims.PAPER_CLAIMS, ids=lambda s: s.name[:40])
def test_every_claim_spec_names_rows_measures_and_checks_that_exist(spec: claims.ClaimSpec):
    names = {r.name for r in RUNS}
    assert set(spec.rows) <= names, f"unknown rows {set(spec.rows) - names}"
    assert spec.test in ("direction", "on_par", "peak")
    assert len(spec.rows) >= (3 if spec.test == "peak" else 2)
    if isinstance(spec.measure, tuple):
        assert len(spec.measure) == len(spec.rows), "one measure per row"
    assert spec.paper in ("MP3", "DropPos", "StoP", "MJP", "RandSAC")
    assert spec.setting and spec.regime and spec.checks
    for check in spec.checks:  # every kind resolves (an unknown one raises)
        ok, why = claims.regime_check({}, check, None, "")
        assert isinstance(ok, bool) and why


def test_the_claims_are_built_from_the_table_in_its_order():
    """No rows: every claim of the table is "not run", in the table's order, named paper + table + claim (a proxy
    measure says that neither stood in); a spec of an unknown regime check is refused."""
    items = claims.claim_items({})
    assert len(items) == len(claims.PAPER_CLAIMS) == 22
    for spec, item in zip(claims.PAPER_CLAIMS, items, strict=True):
        assert item.claim == spec.name + (" (fine-tune or probe)" if spec.measure == claims.PROXY else "")
        assert item.in_regime is None and item.verdict == "not run"
        assert "{here}" not in item.setting and "{budget}" not in item.setting and "{corpus}" not in item.setting
    with pytest.raises(ValueError, match="unknown regime check 'typo'"):
        claims.regime_check({}, ("typo",), None, "")


def test_a_claim_spec_reads_its_rows_measure_and_regime():
    """One spec measured on three seeds: its paired effect on the spec's measure, its regime from its checks."""
    rows = {"mjp_gamma0.27": [{"seed": s, "consistency": 0.9 + s / 100, "validation_top1": 0.8 + s / 50}
                              for s in range(3)],
            "mjp_gamma0.03": [{"seed": s, "consistency": 0.8, "validation_top1": 0.7 + s / 50} for s in range(3)]}
    spec = next(s for s in claims.PAPER_CLAIMS if s.rows == ("mjp_gamma0.27", "mjp_gamma0.03")
                and s.measure == "consistency")
    item = claims.paper_claim(rows, spec, "")
    assert item.in_regime and item.seeds == 3 and item.agrees
    assert item.effect.startswith("+11.0 pt"), item.effect


def test_the_benchmark_options_are_one_function_per_group_in_help_order():
    parser = benchmark.build_parser()
    titles = [g.title for g in parser._action_groups][2:]  # after argparse's positionals / options
    assert len(titles) == len(benchmark.OPTION_GROUPS) == len(set(titles))
    assert titles[:2] == ["matmul", "objectives (and models)"] and titles[-1] == "cpu_equivalence"
