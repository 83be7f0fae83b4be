"""Study v5's pre-registered protocol: the protocol file and its hash, the rows the report refuses, the
CPU-model pairing rule, the PE-free position ceiling, regimes read on validation only, the doubling rule, one Holm
family per question, the paper's effect on the log-odds scale, the one-sided label-efficiency proxy. Synthetic rows
throughout; the end-to-end run (a tiny schedule) is slow."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from patchplace.pipelines import config as pipeline_config
from patchplace.research.reproduction import protocol as proto
from patchplace.research.reproduction.claims import protocol_items
from patchplace.research.reproduction.plan import RUNS, StudyConfig
from patchplace.research.reproduction.schedule import epochs_overrides, mismatch
from patchplace.research.reproduction.stats import holm, paired_test, power

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = ROOT / "research" / "protocols" / "study_v5.yaml"
SHA = "a" * 64
WHEN = datetime(2026, 1, 1, tzinfo=timezone.utc)


def start(machine: str = "AMD EPYC", sha: str = SHA, started: datetime = WHEN + timedelta(hours=1),
          commit: str | None = None) -> dict:
    return {"provenance": {"starts": [{"machine": machine, "cpu_model": machine, "protocol_sha256": sha,
                                       "commit": commit, "started": started.isoformat()}]}}


def curve(values: dict[str, float]) -> dict:
    return {e: {"top1": v} for e, v in values.items()}


def position_rows(validation: float = 0.6, machine: str = "AMD EPYC") -> dict[str, list[dict]]:
    """MP3 eta 0 / 0.75 and both DropPos rows on 5 seeds, their validation measures at ``validation``."""
    rows: dict[str, list[dict]] = {}
    for s in range(5):
        c0 = curve({"0.0": 0.70 + 0.003 * s, "0.55": 0.62, "0.9": 0.40 + 0.004 * s})
        c75 = curve({"0.0": 0.60 + 0.002 * s, "0.55": 0.66 + 0.003 * s, "0.9": 0.55 + 0.001 * s})
        v = curve({"0.0": validation, "0.55": validation})
        rows.setdefault("mp3_eta0", []).append({"seed": s, "mp3_eta_curve": c0, "validation": {"mp3_eta_curve": v},
                                                **start()})
        rows.setdefault("mp3_eta0.75", []).append({"seed": s, "mp3_eta_curve": c75,
                                                   "validation": {"mp3_eta_curve": v}, **start()})
        for name, grid in (("droppos", 0.60 + 0.002 * s), ("droppos_sigma0", 0.62 + 0.003 * s * s)):
            rows.setdefault(name, []).append({"seed": s, "droppos_grid": {"mean": grid},
                                              "validation": {"droppos_grid": {"mean": validation}},
                                              **start(machine if name == "droppos_sigma0" else "AMD EPYC")})
    return rows


def by_id(items: list) -> dict:
    return {c.claim.split(":")[0] + (" probe" if "fine-tunes worse" in c.claim else "") +
            (" eta0.75" if "0.75" in c.claim.split(":")[0] else ""): c for c in items}


# ---------------------------------------------------------------------------------------------- the protocol file
def test_the_protocol_is_data_the_config_runs_what_it_states_and_a_change_is_one_line():
    p = proto.load_protocol(PROTOCOL)
    assert p.sha256 == proto.sha256_of(PROTOCOL) and len(p.sha256) == 64
    names = {r.name for r in RUNS}
    for spec in p.claims:
        assert spec["family"] in p.data["families"]
        sides = [spec["ours"], *([spec["other"]] if "other" in spec else spec["others"])]
        assert {s["row"] for s in sides} <= names
    assert p.ceiling("all_patches", 8) == 0.8211 and p.ceiling("droppos_grid", 4) == 0.6717
    assert p.share == 0.5 and p.data["paper_effect"]["scale"] == "log_odds"
    assert p.data["label_efficiency"]["proxy"] == "one_sided"
    cfg = pipeline_config.load(StudyConfig, str(ROOT / "pipelines/configs/study_v5.yaml"), [])
    assert mismatch(cfg, p) is None
    changed = pipeline_config.load(StudyConfig, str(ROOT / "pipelines/configs/study_v5.yaml"),
                                   ["close_seeds=[0,1,2]", "row_pretrain_epochs={droppos: 4.0, droppos_sigma0: 8.0}"])
    line = mismatch(changed, p)
    assert "\n" not in line and "close_seeds=(0, 1, 2)" in line and "'droppos': 4.0" in line
    # mp3_eta0.75 cannot be a config key (a dot): the MP3 rows take pretrain_epochs, the doubled ones too
    assert epochs_overrides(cfg, {"mp3_eta0": 8.0, "mp3_eta0.75": 8.0}) == [
        "pretrain_epochs=8", "row_pretrain_epochs={droppos: 8, droppos_sigma0: 8, mp3_eta0: 8}"]


def test_the_protocol_is_read_as_the_configs_are_and_a_key_given_twice_is_one_line(tmp_path):
    """YAML 1.2 (``no`` is a string), and a file whose key is given twice, or that is not YAML, is refused in one
    line naming the file, the place and the key (YAML 1.1 readers keep the last value silently)."""
    text = PROTOCOL.read_text()
    assert proto.load_protocol(PROTOCOL).data == yaml.safe_load(text), "the same values as a YAML 1.1 reader's"
    cases = {"twice.yaml": (text + "alpha: 0.5\n", "key 'alpha' is given twice (first at line "),
             "broken.yaml": (text + "alpha: [\n", "not valid YAML")}
    for name, (body, why) in cases.items():
        (tmp_path / name).write_text(body)
        with pytest.raises(proto.ProtocolError) as error:
            proto.load_protocol(tmp_path / name)
        line = str(error.value)
        assert line.startswith(f"protocol {tmp_path / name}, line ") and why in line and "\n" not in line, line


def test_the_droppos_table3_numbers_are_the_papers():
    spec = next(s for s in proto.load_protocol(PROTOCOL).claims if s["id"] == "droppos_t3_position")
    assert spec["paper"] == {"ours": 0.8881, "other": 0.8783}


# ---------------------------------------------------------------------------------------------- the PE-free ceiling
def test_the_pe_free_ceiling_counts_one_position_per_group_of_identical_patches():
    blank = torch.zeros(1, 1, 8, 8, dtype=torch.uint8)  # 4 identical 4 px patches: one can be right
    assert proto.position_ceiling(blank, 4) == pytest.approx(1 / 4)
    distinct = torch.arange(64, dtype=torch.uint8).reshape(1, 1, 8, 8)
    assert proto.position_ceiling(distinct, 4) == 1.0
    half = distinct.clone()
    half[0, 0, :4, :] = 0  # the top two patches blank: 3 distinct of 4
    assert proto.position_ceiling(half, 4) == pytest.approx(3 / 4)
    both = torch.cat([blank, distinct])  # pooled over the images: (1 + 4) / 8
    assert proto.position_ceiling(both, 4) == pytest.approx(5 / 8)
    # DropPos asks only the visible patches whose PE is dropped: fewer collide, so its ceiling is at least MP3's
    image = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16)
    image[0, 0, :8, :] = 0  # 8 blank patches of 16: MP3's ceiling (1 + 8) / 16
    images = torch.cat([image] * 8)
    assert proto.position_ceiling(images, 4) == pytest.approx(9 / 16)
    assert 9 / 16 < proto.droppos_grid_ceiling(images, 4) < 1.0
    assert proto.droppos_grid_ceiling(torch.zeros(8, 1, 16, 16, dtype=torch.uint8), 4) < \
        proto.droppos_grid_ceiling(torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16), 4) == 1.0
    assert proto.ceilings_of_split(both, (4,))["all_patches@4"] == 0.625


FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.slow
@pytest.mark.skipif(not (FASHION / "train-images-idx3-ubyte.gz").is_file(), reason="no Fashion-MNIST IDX files")
def test_the_protocols_ceilings_are_those_of_the_validation_images(tmp_path):
    """On Fashion-MNIST padded to 32 px (the 5,000 validation images): 62.2% at 4 px, 82.1% at 8 px (the test
    split: 62.3% / 82.2%), as the protocol records them. The shards are written by the recipe that
    data/fashion_mnist.py runs (its command line's shard limits are the recipe's defaults), in this process."""
    from patchplace.pipelines.datasets.fashion_mnist import build

    build(FASHION, tmp_path / "fm", progress=False)
    images = proto.validation_images(tmp_path / "fm" / "train", 5000, 0, 32)
    recorded = proto.load_protocol(PROTOCOL).data["ceilings"]["values"]
    assert proto.ceilings_of_split(images, (4, 8)) == recorded


# ------------------------------------------------------------------------------------- refusals and the pairing rule
def test_rows_trained_before_the_protocol_or_under_another_hash_are_refused_one_line_each():
    commit = proto.Commit("c" * 40, WHEN, dirty=False)
    rows = {"mp3_eta0": [{"seed": 0, **start()}, {"seed": 1, **start(started=WHEN - timedelta(days=1))},
                         {"seed": 2, **start(sha="b" * 64)}, {"seed": 3}],
            "droppos": [{"seed": 0, **start()}]}
    kept, lines = proto.refusals(rows, SHA, commit)
    assert [m["seed"] for m in kept["mp3_eta0"]] == [0] and kept["droppos"]
    assert len(lines) == 3 and all("\n" not in line and line.startswith("refused: mp3_eta0 seed(s) ")
                                   for line in lines)
    assert any("before the protocol's commit cccccccccc" in line for line in lines)
    assert any("ran under protocol hash bbbbbbbbbbbb" in line for line in lines)
    assert any("no provenance: trained before the protocol" in line for line in lines)
    _, lines = proto.refusals({"droppos": [{"seed": 0, **start()}]}, SHA, None)  # not committed: nothing counts
    assert lines == ["refused: droppos seed(s) 0: the protocol is not committed: no row counts until it is"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_a_row_is_refused_by_its_commit_and_rows_need_the_protocol_committed_unchanged(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.txt").write_text("v4")
    _git(tmp_path, "add", "code.txt")
    _git(tmp_path, "commit", "-qm", "before")
    before = _git(tmp_path, "rev-parse", "HEAD")
    protocol = tmp_path / "protocol.yaml"
    protocol.write_text("version: 5\n")
    assert "is not committed" in proto.unregistered(protocol)
    _git(tmp_path, "add", "protocol.yaml")
    _git(tmp_path, "commit", "-qm", "protocol")
    assert proto.unregistered(protocol) is None
    commit = proto.protocol_commit(protocol)
    assert commit.sha == _git(tmp_path, "rev-parse", "HEAD") and not commit.dirty
    sha = proto.sha256_of(protocol)
    late = WHEN + timedelta(days=3650)  # a start time after the commit cannot rescue a commit before it
    old = {"seed": 0, **start(sha=sha, commit=before, started=late)}
    new = {"seed": 1, **start(sha=sha, commit=commit.sha, started=WHEN)}  # by ancestry, not by the clock
    kept, lines = proto.refusals({"mp3_eta0": [old, new]}, sha, commit, tmp_path)
    assert [m["seed"] for m in kept["mp3_eta0"]] == [1]
    assert lines == [f"refused: mp3_eta0 seed(s) 0: ran at commit {before[:10]}, which predates the protocol's "
                     f"commit {commit.sha[:10]}"]
    protocol.write_text("version: 5  # edited\n")
    assert "differs from its commit" in proto.unregistered(protocol)
    record = proto.record_start(tmp_path / "run", protocol)
    assert record["protocol_sha256"] == proto.sha256_of(protocol) and record["commit"] == commit.sha
    assert record["cpu_model"] == proto.cpu_model() and record["machine"]
    assert len(proto.read_starts(tmp_path / "run" / proto.PROVENANCE)) == 1


def test_a_unit_records_its_start_when_a_stage_runs_and_a_visit_to_a_finished_unit_records_nothing(tmp_path):
    from patchplace.research.reproduction.runner import Study

    study = Study.__new__(Study)  # (its stage wrapper alone: the config it reads is the protocol's path)
    study.cfg, study.unstarted = StudyConfig(protocol=None), tmp_path / "unit"
    provenance = tmp_path / "unit" / proto.PROVENANCE
    ran: list[list[str]] = []
    assert study.stage(tmp_path / "unit" / "pretrain", lambda argv: ran.append(argv) or 0, ["a=1"]) >= 0
    assert ran == [["a=1"]] and len(proto.read_starts(provenance)) == 1 and study.unstarted is None
    study.unstarted = tmp_path / "unit"  # the unit visited again: its stage is DONE, so nothing runs or records
    study.stage(tmp_path / "unit" / "pretrain", lambda argv: ran.append(argv) or 0, ["a=1"])
    assert ran == [["a=1"]] and len(proto.read_starts(provenance)) == 1


def test_a_claim_never_pairs_rows_from_two_cpu_models():
    p = proto.load_protocol(PROTOCOL)
    same = by_id(protocol_items(position_rows(), p))
    assert same["DropPos Table 3"].tested
    mixed = position_rows(machine="Intel(R) Xeon(R) Processor")  # sigma 0 on the Xeon, its baseline on the EPYC
    items = by_id(protocol_items(mixed, p))
    claim = items["DropPos Table 3"]
    assert not claim.tested and claim.adjusted is None
    assert claim.verdict == ("not paired: rows from 2 machine models (AMD EPYC; Intel(R) Xeon(R) Processor) are "
                             "never paired: rerun the claim's rows on one")
    assert "95% CI" not in claim.verdict  # no effect from a pair it refuses
    assert items["MP3 Fig. 3 (train eta 0)"].tested, "a claim of one model's rows is still paired"
    rows = position_rows()
    rows["mp3_eta0"][2].update(start("Intel(R) Xeon(R) Processor"))  # one seed of one row on another model
    assert "not paired" in by_id(protocol_items(rows, p))["MP3 Fig. 3 (train eta 0)"].verdict


# --------------------------------------------------------------------- regimes on validation, families, the scales
def test_a_position_claim_needs_its_pretext_learned_to_half_the_ceiling_on_validation():
    p = proto.load_protocol(PROTOCOL)
    learned = by_id(protocol_items(position_rows(validation=0.45), p))  # >= 0.5 x 82.1% and >= 0.5 x 89.2%
    assert learned["MP3 Fig. 3 (train eta 0)"].in_regime
    assert learned["DropPos Table 3"].in_regime is True
    short = by_id(protocol_items(position_rows(validation=0.43), p))
    assert short["MP3 Fig. 3 (train eta 0)"].in_regime and short["DropPos Table 3"].in_regime is False
    assert "droppos position_grid on validation 43.0% < 0.5 x the PE-free ceiling 89.1% = 44.6%" in \
        short["DropPos Table 3"].verdict
    unlearned = by_id(protocol_items(position_rows(validation=0.40), p))["MP3 Fig. 3 (train eta 0)"]
    assert unlearned.in_regime is False and unlearned.verdict.startswith("out of regime at this budget")
    rows = position_rows()  # the test split's numbers are high, but without validation numbers: fails closed
    for m in rows["mp3_eta0"]:
        del m["validation"]
    assert by_id(protocol_items(rows, p))["MP3 Fig. 3 (train eta 0)"].in_regime is False
    # at 4 px (the GPU's rows) the same claims read the 4 px ceilings
    at4 = by_id(protocol_items(position_rows(validation=0.32), p, {"patch_size": 4}))
    assert at4["MP3 Fig. 3 (train eta 0)"].in_regime and "4 px patches (64 positions)" in \
        at4["MP3 Fig. 3 (train eta 0)"].setting


def test_a_claim_before_all_its_planned_seeds_is_pending_and_its_family_decides_nothing():
    p = proto.load_protocol(PROTOCOL)
    assert p.planned_seeds("mp3_eta0") == [0, 1, 2, 3, 4] and p.planned_seeds("mjp") == [0, 1, 2]
    rows = {name: [m for m in ms if m["seed"] < 3] for name, ms in position_rows().items()}
    items = by_id(protocol_items(rows, p))
    claim = items["MP3 Fig. 3 (train eta 0)"]
    assert claim.pending == "3 of 5 seeds" and not claim.tested and claim.adjusted is None, \
        "3 seeds are enough for a test, but the protocol plans 5: no test before the last (no optional stopping)"
    assert claim.verdict.startswith("pending (3 of 5 seeds); so far: ")
    assert "raw p" not in claim.verdict
    assert not any(c.tested for c in items.values() if c.family == "position")
    done = by_id(protocol_items(position_rows(), p))["MP3 Fig. 3 (train eta 0)"]
    assert not done.pending and done.tested
    below = {name: [m for m in ms if m["seed"] == 0] for name, ms in position_rows(validation=0.40).items()}
    stopped = by_id(protocol_items(below, p))["MP3 Fig. 3 (train eta 0)"]
    assert not stopped.pending and stopped.in_regime is False, "below its level on what ran: out of regime, not pending"
    # MP3's rows whole, DropPos's at seed 0: MP3's claims have their tests, but their family waits for DropPos's
    mixed = {name: [m for m in ms if name.startswith("mp3") or m["seed"] == 0] for name, ms in position_rows().items()}
    family = [c for c in protocol_items(mixed, p) if c.family == "position"]
    tested = [c for c in family if c.tested]
    assert len(family) == 3 and len(tested) == 2 and [c.pending for c in family if not c.tested] == ["1 of 5 seeds"]
    assert all(c.adjusted is None and c.verdict.startswith("undecided") for c in tested), \
        "no verdict while a claim of the family is pending: it would depend on when the report was read"
    whole = sorted((c for c in protocol_items(position_rows(), p) if c.family == "position"), key=lambda c: c.p)
    assert [c.adjusted for c in whole] == holm([c.p for c in whole])


def test_holm_runs_within_each_family_and_mjp_table1_reads_validation_convergence_and_log_odds():
    p = proto.load_protocol(PROTOCOL)
    rows = position_rows(validation=0.6)
    for s in range(3):
        common = {"stopped": "early", "epochs_cap": 10.0, "validation_top1": 0.86}
        rows.setdefault("supervised", []).append({"seed": s, "consistency": 0.885 + 0.004 * s, **common, **start()})
        rows.setdefault("mjp", []).append({"seed": s, "consistency": 0.97 + 0.002 * s * s, **common, **start()})
    items = by_id(protocol_items(rows, p))
    position = [c for c in items.values() if c.family == "position" and c.tested]
    assert len(position) == 3
    mjp = items["MJP Table 1"]
    assert mjp.family == "robustness" and mjp.in_regime and mjp.adjusted == pytest.approx(mjp.p), \
        "a family of one: Holm does not multiply it by the other families' sizes"
    assert mjp.verdict.startswith("agrees (+")
    # +8.3 pt where the paper has +18.6: excluded on a difference by arithmetic (88.7% leaves +11.3), not on
    # log-odds: logit(0.971) - logit(0.889) = 1.4 > the paper's 0.99
    assert mjp.paper_effect == pytest.approx(0.992, abs=0.01)
    assert not mjp.paper_excluded and "the paper's effect (log-odds +0.99) not excluded" in mjp.verdict
    rows["supervised"][1]["stopped"] = "cap, improving"  # a baseline at its cap: out of regime
    capped = by_id(protocol_items(rows, p))["MJP Table 1"]
    assert capped.in_regime is False and "supervised ran to its 10-epoch cap" in capped.verdict
    rows["mjp"][0]["stopped"] = "cap, improving"  # both at their cap: the report names each with its seeds
    both = by_id(protocol_items(rows, p))["MJP Table 1"].verdict
    assert "mjp ran to its 10-epoch cap (or did not stop on validation) on seed(s) 0; supervised ran" in both \
        and "on seed(s) 1: not converged" in both
    rows["supervised"][1]["stopped"] = rows["mjp"][0]["stopped"] = "early"
    for m in rows["supervised"]:
        m["validation_top1"] = 0.79  # below the raw-pixel probe on validation (80.7%)
    below = by_id(protocol_items(rows, p))["MJP Table 1"]
    assert below.in_regime is False and "supervised validation top-1 79.0% < raw pixels 80.7%" in below.verdict


def test_the_doubling_rule_doubles_once_where_seed_0_is_below_on_validation():
    levels = {"mp3_eta0": 0.41, "mp3_eta0.75": 0.41}
    stay = proto.doubling_decision({"mp3_eta0": 0.5, "mp3_eta0.75": 0.45}, levels, 4.0)
    assert stay["doubled"] is False and stay["epochs"] == 4.0 and stay["below"] == []
    double = proto.doubling_decision({"mp3_eta0": 0.5, "mp3_eta0.75": 0.40}, levels, 4.0)
    assert double["doubled"] and double["epochs"] == 8.0 and double["below"] == ["mp3_eta0.75"]
    assert proto.doubling_decision({"mp3_eta0": None, "mp3_eta0.75": 0.5}, levels, 4.0)["doubled"], \
        "not measured on validation: fails closed"


# ------------------------------------------------------------------------------------------------ end to end (slow)
def tiny_protocol(repo: Path) -> Path:
    """The v5 protocol at a toy budget (holdout 24, MP3 rows only, seeds 0-1, 0.25 epoch), committed in
    ``repo``."""
    data = yaml.safe_load(PROTOCOL.read_text())
    data["data"]["holdout"] = 24
    data["seeds"] = {"position": [0, 1], "classifiers": [0], "speech": [0]}
    data["epochs"]["mp3"]["pretrain"] = 0.25
    data["doubling"]["groups"] = ["mp3"]
    path = repo / "protocol.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    _git(repo, "init", "-q")
    _git(repo, "add", "protocol.yaml")
    _git(repo, "commit", "-qm", "protocol")
    return path


def tiny(shards: Path, tmp_path: Path, protocol: Path) -> list[str]:
    return [f"protocol={protocol}", f"fashion_mnist={shards / 'img'}", "preset=vit_micro", "holdout=24",
            "batch_size=8", "num_workers=0", f"runs={tmp_path / 'runs'}", f"results={tmp_path / 'results'}",
            "probe_train_samples=16", "probe_val_samples=16", "probe_epochs=1", "gate_val_samples=24",
            "curve_samples=16", "test_samples=16", "threads=1"]


@pytest.mark.slow
def test_the_schedule_runs_seed_0_doubles_on_validation_and_the_report_refuses_other_hashes(shards, tmp_path, capsys):
    from patchplace.research import study

    repo = tmp_path / "repo"
    repo.mkdir()
    protocol = tiny_protocol(repo)
    args = [*tiny(shards, tmp_path, protocol), "only=[mp3_eta0,mp3_eta0.75]", "groups=[mp3_eta]",
            "close_rows=[mp3_eta0,mp3_eta0.75]", "close_seeds=[0,1]", "ablation_seeds=[0,1]", "seeds=[0]",
            "speech_seeds=[0]", "pretrain_epochs=0.25"]
    config = str(ROOT / "pipelines/configs/study_v5.yaml")
    assert study.main(["--config", config, *args, "close_seeds=[0]"]) == 2  # not what the protocol states
    assert "the config does not run what" in capsys.readouterr().err
    assert study.main(["--jobs", "2", "--config", config, *args]) == 0
    out = capsys.readouterr().out
    decisions = json.loads((tmp_path / "results" / "study_v5_decisions.json").read_text())
    assert decisions["protocol_sha256"] == proto.sha256_of(protocol)
    mp3 = decisions["groups"]["mp3"]  # random images: the position task is far below 41%: doubled once
    assert mp3["doubled"] and mp3["epochs"] == 0.5 and set(mp3["below"]) == {"mp3_eta0", "mp3_eta0.75"}
    assert sorted(p.name for p in (tmp_path / "runs" / "seed0").iterdir()) == [
        "mp3_eta0.75@e0.25", "mp3_eta0.75@e0.5", "mp3_eta0@e0.25", "mp3_eta0@e0.5"]
    assert not (tmp_path / "runs" / "seed1" / "mp3_eta0@e0.25").exists(), "later seeds run the decided epochs only"
    report = (tmp_path / "results" / "study_v5.md").read_text()
    assert f"sha256 `{proto.sha256_of(protocol)}`" in report and f"sha256 `{proto.sha256_of(protocol)}`" in out
    assert "Rows counted: 4; refused: 0" in report and "| mp3_eta0 | mp3_eta@0.0 | 2 |" in report
    assert study.main(["--config", config, *args]) == 0, "resumed after the decision: the config still matches"
    assert "[study] doubling rule" not in capsys.readouterr().out, "a recorded decision is never taken again"
    starts = json.loads((tmp_path / "runs/seed1/mp3_eta0@e0.5" / proto.PROVENANCE).read_text())["starts"]
    assert starts[0]["protocol_sha256"] == proto.sha256_of(protocol) and starts[0]["cpu_model"] == proto.cpu_model()
    # the protocol changed and committed: the rows ran under the old hash; the report refuses each, one line
    protocol.write_text(protocol.read_text() + "# amended\n")
    assert study.main(["--config", config, *args]) == 2
    assert "differs from its commit" in capsys.readouterr().err
    _git(repo, "commit", "-qam", "amended")
    assert study.main(["--config", config, *args, "--report-only"]) == 0
    refused = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[study] refused: ")]
    assert len(refused) == 2 and all("ran under protocol hash" in line for line in refused)


def test_the_power_of_a_paired_test_is_its_rejection_rate_by_simulation():
    """The power the report states beside the paper's effect in points, against 20,000 simulated 5-seed studies
    (normal seed differences with the measured spread) tested by scipy's own paired t-test."""
    from scipy.stats import ttest_1samp

    rng = np.random.default_rng(0)
    test = paired_test({s: 0.01 * s for s in range(5)}, {s: 0.012 * s + 0.004 * (s % 2) for s in range(5)})
    sd = test.se * 5 ** 0.5
    draws = rng.normal(0.0098, sd, size=(20000, 5))
    rate = float((ttest_1samp(draws, 0.0, axis=1).pvalue < 0.05).mean())
    assert power(test, 0.0098) == pytest.approx(rate, abs=0.01)


def test_the_v5_report_regenerated_from_its_results_is_the_committed_one(tmp_path):
    """results/study_v5.md from results/study_v5.json (no run directory): the same report, line for line, but the
    hardware of the machine that writes it."""
    from patchplace.research import study

    for name in ("study_v5.json", "study_v5_decisions.json"):
        (tmp_path / name).write_text((ROOT / "results" / name).read_text())
    args = ["--config", str(ROOT / "pipelines" / "configs" / "study_v5.yaml"), "--report-only",
            f"results={tmp_path}", f"runs={tmp_path / 'runs'}"]
    assert study.main(args) == 0
    new, old = ((d / "study_v5.md").read_text().splitlines() for d in (tmp_path, ROOT / "results"))
    assert [ln for ln in new if not ln.startswith("Hardware")] == [ln for ln in old if not ln.startswith("Hardware")]
    assert "**not reproduced at 16 positions, 4 epochs**" in "\n".join(new) and "contradicts**" not in "\n".join(new)
