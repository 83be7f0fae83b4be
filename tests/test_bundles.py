"""The study's sitting bundles as they come back from lent machines: every damaged bundle is one line naming the file
and what is wrong, its unit pending for --sitting and listed by --merge; a bundle without rows is pending; a stale
copy of a bundle never replaces the numbers of the bundle named after its unit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from patchplace.pipelines import config as pipeline_config
from patchplace.research import study
from patchplace.research.reproduction.metrics import HARNESS_VERSION
from patchplace.research.reproduction.plan import StudyConfig
from patchplace.research.reproduction.sittings import bundles_of, merged_study, pending_units

ROOT = Path(__file__).resolve().parents[1]


def _args(tmp_path: Path) -> list[str]:
    return [f"runs={tmp_path / 'unused'}", f"results={tmp_path / 'results'}", "groups=[randsac]",
            "probe_only=[randsac]", "only=[randsac_raster]", "ablation_seeds=[0,1]", "compare_with=null"]


def _bundle(cfg: StudyConfig, seed: int, probe: float, sitting: str = "20250101T000000Z", **changes) -> dict:
    """What a sitting writes for unit randsac.seed<seed> (one row, randsac_raster)."""
    bundle = {"unit": f"randsac.seed{seed}", "groups": ["randsac"], "seed": seed, "only": [], "seconds": 60.0,
              "sitting": sitting, "device": "cpu", "torch": "2.x", "harness": HARNESS_VERSION,
              "config": dataclasses.asdict(cfg), "rows": {"randsac_raster": [{"seed": seed, "linear_probe": probe}]},
              "controls": None, "curves": None}
    return {**bundle, **changes}


def _write(path: Path, value) -> None:
    path.write_text(json.dumps(value))


def _merge(args: list[str], bundles: Path, capsys) -> tuple[int, str, str]:
    code = study.main([*args, "--merge", "--bundles", str(bundles)])
    out, err = capsys.readouterr()
    return code, out, err


def _damages(cfg: StudyConfig, bundles: Path) -> dict[str, tuple]:
    """Damage kind -> (how the file is made, what its one line says)."""
    good = _bundle(cfg, 1, 0.5)
    unit = bundles / "randsac.seed1.json"
    return {
        "truncated JSON": (lambda: unit.write_text(json.dumps(good)[:80]), "not valid JSON"),
        "empty file": (lambda: unit.write_text(""), "empty"),
        "directory": (lambda: unit.mkdir(), "a directory, not a bundle file"),
        "not UTF-8": (lambda: unit.write_bytes(b"\xff\xfe{"), "not UTF-8"),
        "a JSON array": (lambda: _write(unit, [good]), "not an object"),
        "missing keys": (lambda: _write(unit, {k: v for k, v in good.items() if k != "rows"}), "no rows"),
        "wrong types": (lambda: _write(unit, {**good, "seed": "1"}), 'seed is "1", expected int'),
        "wrong row types": (lambda: _write(unit, {**good, "rows": {"randsac_raster": {"seed": 1}}}), "not a list"),
        "unit not its fields": (lambda: _write(unit, {**good, "seed": 0}), "is not the one its groups"),
        "unknown group": (lambda: _write(unit, {**good, "groups": ["nope"], "unit": "nope.seed1"}),
                          "not the study's groups"),
        "unknown unit": (lambda: _write(bundles / "randsac.seed7.json", _bundle(cfg, 7, 0.5)),
                         "not one of this config's units"),
        "another row": (lambda: _write(unit, {**good, "rows": {"mae": [{"seed": 1}]}}), "not a row of unit"),
        "no rows": (lambda: _write(unit, {**good, "rows": {}}), "holds no rows"),
        "not a duration": (lambda: _write(unit, {**good, "seconds": float("nan")}), "not a duration"),
        "other budget": (lambda: _write(unit, {**good, "config": {**good["config"], "pretrain_epochs": 9.0}}),
                         "measured at another budget (pretrain_epochs differ"),
        "config without budget": (lambda: _write(unit, {**good, "config": {}}), "lacks the budget field"),
    }


def test_every_damaged_bundle_is_one_line_and_its_unit_stays_pending(tmp_path, capsys):
    args = _args(tmp_path)
    cfg = pipeline_config.load(StudyConfig, None, args)
    units = study.study_units(cfg)
    bundles = tmp_path / "bundles"
    for kind, (damage, said) in _damages(cfg, bundles).items():
        if bundles.exists():
            for path in bundles.iterdir():
                path.rmdir() if path.is_dir() else path.unlink()
        bundles.mkdir(exist_ok=True)
        _write(bundles / "randsac.seed0.json", _bundle(cfg, 0, 0.25))
        damage()
        assert pending_units(units, bundles, cfg) == ["randsac.seed1"], kind
        # --sitting: the damaged unit is pending (nothing run: --max-units 0)
        assert study.main([*args, "--sitting", "5", "--max-units", "0", "--bundles", str(bundles)]) == 0, kind
        out, err = capsys.readouterr()
        assert "1 unit(s) in" in out and "1 pending" in out and "Traceback" not in out + err, (kind, out, err)
        (line,) = [x for x in err.splitlines() if x.strip()]
        assert said in line and str(bundles) in line, (kind, line)
        # --merge: reported in one line, the good bundle merged, the damaged unit listed as pending
        code, out, err = _merge(args, bundles, capsys)
        (line,) = [x for x in err.splitlines() if x.strip()]
        assert code == 0 and said in line and "Traceback" not in err, (kind, err)
        assert "from 1 of 2 units; pending: randsac.seed1" in out, (kind, out)
        merged = json.loads((tmp_path / "results" / "study.json").read_text())["results"]
        assert [(m["seed"], m["linear_probe"]) for m in merged["randsac_raster"]] == [(0, 0.25)], kind


def test_a_stale_copy_never_replaces_the_bundle_named_after_its_unit(tmp_path, capsys):
    args = _args(tmp_path)
    cfg = pipeline_config.load(StudyConfig, None, args)
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    _write(bundles / "randsac.seed0.json", _bundle(cfg, 0, 0.25, sitting="20250102T000000Z"))
    _write(bundles / "randsac.seed1.json", _bundle(cfg, 1, 0.5))
    for copy in ("randsac.seed0.old.json", "randsac.seed0 (1).json", "z.json"):  # sort after the real one
        _write(bundles / copy, _bundle(cfg, 0, 0.99, sitting="20240101T000000Z"))
    code, out, err = _merge(args, bundles, capsys)
    assert code == 0 and "from 2 of 2 units; pending: none" in out
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all("holds unit randsac.seed0 but is not named randsac.seed0.json" in x
                                   for x in lines), err
    merged = json.loads((tmp_path / "results" / "study.json").read_text())["results"]["randsac_raster"]
    assert [(m["seed"], m["linear_probe"]) for m in merged] == [(0, 0.25), (1, 0.5)]
    assert sorted(bundles_of(bundles, cfg, quiet=True)) == ["randsac.seed0", "randsac.seed1"]
    # a (row, seed) measured by two units (a study switched to unit_per_row): the newer sitting's, in one line
    row = _bundle(cfg, 0, 0.75, sitting="20250103T000000Z", unit="randsac.randsac_raster.seed0",
                  only=["randsac_raster"])
    _write(bundles / "randsac.randsac_raster.seed0.json", row)
    for copy in ("randsac.seed0.old.json", "randsac.seed0 (1).json", "z.json"):
        (bundles / copy).unlink()
    payload = merged_study(cfg, bundles)
    assert [m["linear_probe"] for m in payload["results"]["randsac_raster"]] == [0.75, 0.5]
    assert "randsac_raster seed 0: measured by randsac.seed0" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["file", "missing"])
def test_bundles_that_is_not_a_directory_is_one_line(tmp_path, capsys, what):
    bundles = tmp_path / "bundles"
    if what == "file":
        bundles.write_text("x")
    code, _, err = _merge(_args(tmp_path), bundles, capsys)
    assert code == 2 and err.startswith("error: --bundles") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()
