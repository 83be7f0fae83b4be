"""The reproduction study (``pipelines/study.py`` and its modules): every stage end to end on tiny data with
resume, the job split, merging earlier results, the learned gate and Holm."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading

import pytest
import yaml

from patchplace.pipelines import config as pipeline_config
from patchplace.pipelines import stages
from patchplace.research import study
from patchplace.research.reproduction.gate import gate
from patchplace.research.reproduction.metrics import HARNESS_VERSION, collect
from patchplace.research.reproduction.plan import GROUPS, RUNS, StudyConfig
from patchplace.research.reproduction.report import commands_so_far
from patchplace.research.reproduction.runner import Study
from patchplace.research.reproduction.stats import holm


def measured(args: list[str]) -> dict:
    """The rows a study command's stages left (a config without a protocol writes no report)."""
    parsed = [a for a in args if "=" in a and not a.startswith("--")]
    config = args[args.index("--config") + 1] if "--config" in args else None
    return collect(Study(pipeline_config.load(StudyConfig, config, parsed)))


@pytest.mark.slow
def test_study_runs_every_stage_resumes_and_reports(shards, tmp_path, capsys):
    """The main rows (supervised and MJP from scratch to convergence on validation, MP3 fine-tuned, DropPos probed
    only), speech with two seeds, under the held-out protocol (a validation split held out of train, the test split
    read once per final number), on tiny data; run again, every stage is skipped."""
    args = [f"runs={tmp_path / 'runs'}", f"results={tmp_path / 'results'}", "preset=vit_micro",
            "pretrain_epochs=0.25", "finetune_epochs=0.25", "batch_size=8", "num_workers=0",
            f"fashion_mnist={shards / 'img'}", f"spoken_keywords={shards / 'audio'}", "groups=[main,speech]",
            "only=[supervised,mp3,droppos,mjp,speech_supervised,speech_mp3]", "full_label_rows=[supervised,mp3,mjp]",
            "first_seed_finetunes=false", "classifier_patience=2", "classifier_eval_epochs=0.25",
            "probe_train_samples=32", "holdout=12", "gate_val_samples=12", "probe_val_samples=32", "probe_epochs=2",
            "curve_samples=16", "test_samples=32", "speech_pretrain_epochs=1", "speech_finetune_epochs=1",
            "speech_seeds=[0,1]", "overrides=[data.shuffle_buffer=16]", "speech_overrides=[data.batch_size=8]",
            "seeds=[0]"]
    assert study.main(args) == 0
    rows = measured(args)
    assert set(rows) == {"supervised", "mp3", "droppos", "mjp", "speech_supervised", "speech_mp3"}
    droppos = rows["droppos"][0]  # not a full-label row: pretrained, gated and probed, not fine-tuned
    assert droppos["top1"] is None and droppos["finetune_pe"] == "(probes only)" and "droppos_grid" in droppos
    assert not (tmp_path / "runs" / "seed0" / "droppos" / "finetune").exists()
    sup, mp3, mjp = rows["supervised"][0], rows["mp3"][0], rows["mjp"][0]
    assert sup["pretrain_epochs"] == 0 and sup["finetune_epochs"] == 0.5, "supervised: the same total epochs"
    assert sup["stopped"] in ("early", "cap", "cap, improving") and sup["epochs_cap"] == 0.5
    assert mp3["pretrain_epochs"] == 0.25 and mp3["finetune_pe"] == "learned" and mp3["top1"] is not None
    assert "position_accuracy" in mp3 and "mp3_eta_curve" in mp3 and "consistency" in mjp
    for m in (mp3, droppos):  # the learned gate: validation, beside the random init of its architecture
        assert set(m["gate"]["probe"]) == {"0.25"} and m["gate"]["val_samples"] == 12
        assert "linear_probe_1pct" in m and "knn" not in m and "position_probe" not in m
    runs = tmp_path / "runs" / "seed0"
    tested = json.loads((runs / "supervised" / "eval" / "results.json").read_text())
    assert tested["classification"]["count"] == 32, "the final number: the test split, read once"
    used = yaml.safe_load((runs / "supervised" / "train" / "config.yaml").read_text())
    assert used["data"]["val"] == "holdout" and used["run"]["early_stop_patience"] == 2
    pre = yaml.safe_load((runs / "mp3" / "pretrain" / "config.yaml").read_text())["data"]
    assert pre["val"] == "holdout" and pre["holdout"] == 12, "pretraining never reads the validation images"
    assert rows["speech_supervised"][0]["finetune_epochs"] == 1, "speech: as many updates as the fine-tune"
    assert [m["seed"] for m in rows["speech_mp3"]] == [0, 1]
    capsys.readouterr()
    assert study.main(args) == 0  # resumes: every stage is skipped
    out = capsys.readouterr().out
    assert "done before, skipping" in out and "] --config" not in out


@pytest.mark.slow
def test_study_fine_tunes_with_all_labels_only_the_full_label_rows_on_later_seeds(shards, tmp_path):
    """full_label_rows: the other main rows are fine-tuned with all labels on the first seed only, while their
    pretraining and probes take every seed."""
    args = [f"runs={tmp_path / 'runs'}", f"results={tmp_path / 'results'}", "preset=vit_micro",
            "pretrain_epochs=0.25", "finetune_epochs=0.25", "batch_size=8", "num_workers=0",
            f"fashion_mnist={shards / 'img'}", "groups=[main]", "only=[supervised,mae]", "seeds=[0,1]",
            "full_label_rows=[supervised]", "probe_train_samples=16", "probe_val_samples=16", "probe_epochs=1",
            "curve_samples=8", "test_samples=16", "holdout=12", "gate=false"]
    assert study.main([*args, "only_seeds=[1]"]) == 0  # as one --jobs process: seed 1 alone, still not the first
    assert not (tmp_path / "runs" / "seed0").exists() and (tmp_path / "runs" / "seed1" / "mae" / "probe").is_dir()
    assert not (tmp_path / "runs" / "seed1" / "mae" / "finetune").exists()
    assert study.main(args) == 0
    rows = measured(args)
    mae = {m["seed"]: m for m in rows["mae"]}
    assert mae[0]["top1"] is not None and mae[1]["top1"] is None and mae[1]["finetune_pe"] == "(probes only)"
    assert "linear_probe" in mae[1] and "gate" not in mae[1], "gate=false: no gate stage"
    assert [m["seed"] for m in rows["supervised"] if m["top1"] is not None] == [0, 1]
    runner = Study(pipeline_config.load(StudyConfig, None, [*args, "first_seed_finetunes=false"]))
    mae_run, supervised_run = (next(r for r in RUNS if r.name == n) for n in ("mae", "supervised"))
    assert not runner.full_label(mae_run, 0) and runner.full_label(supervised_run, 0), \
        "first_seed_finetunes=false: the other main rows are probed only, on every seed"
    with pytest.raises(pipeline_config.ConfigError, match="full_label_rows"):
        pipeline_config.load(StudyConfig, None, ["full_label_rows=[droppos_sigma0]"])


def test_study_jobs_pull_units_from_one_queue_and_stages_refuse_a_busy_directory(tmp_path):
    cfg = pipeline_config.load(StudyConfig, None, ["seeds=[0,1,2]", "ablation_seeds=[0,1,2]", "speech_seeds=[0,1]",
                                                   "full_label_rows=[supervised]", f"runs={tmp_path / 'runs'}"])
    units = study.study_units(cfg)
    pairs = [(g, u.seed) for u in units for g in u.groups]
    expected = [(g, s) for g in GROUPS for s in ((0, 1) if g == "speech" else (0, 1, 2))]
    assert sorted(pairs) == sorted(expected) and len(pairs) == len(set(pairs)), "every (group, seed) exactly once"
    keys = [(cfg.groups.index(u.groups[0]), u.seed) for u in units]
    assert keys == sorted(keys), "the queue keeps the priority order of groups, then the seed order"
    assert units[0].overrides() == ["groups=[main]", "only_seeds=[0]"]

    # Dynamic balance: job 0 is held on its first unit until job 1 has run every other unit (a static split
    # would have given job 0 about half of them and this would time out).
    released, ran, lock = threading.Event(), [], threading.Lock()

    def call(argv, stdout, stderr):
        with lock:
            first = not ran
            ran.append((argv[-4], argv[-3]))
            assert argv[-1] == "--no-report", "a unit runs stages only: the report is written once, at the end"
        if first:
            assert released.wait(timeout=60), "job 1 did not take the other units while job 0 was busy"
        elif len(ran) == len(units):
            released.set()
        return 0

    args = argparse.Namespace(jobs=2, config=None, overrides=[])
    assert study.run_jobs(args, cfg, call=call) == 0
    assert sorted(ran) == sorted((f"groups=[{','.join(u.groups)}]", f"only_seeds=[{u.seed}]") for u in units)
    failing = argparse.Namespace(jobs=2, config=None, overrides=[])
    assert study.run_jobs(failing, cfg, call=lambda argv, stdout, stderr: 1) == 1, "a failed unit fails the study"
    with pytest.raises(pipeline_config.ConfigError, match="probe_only"):
        pipeline_config.load(StudyConfig, None, ["probe_only=[main]"])
    (tmp_path / "LOCK").write_text(str(os.getppid()))  # a live process holds the stage
    with pytest.raises(stages.StageError, match="is being run by process"):
        stages.stage(tmp_path, lambda argv: 0, [])
    (tmp_path / "LOCK").write_text("999999999")  # its process is gone: taken over
    assert stages.stage(tmp_path, lambda argv: 0, []) >= 0 and (tmp_path / "DONE").is_file()
    assert not (tmp_path / "LOCK").exists()
    with pytest.raises(stages.StageError, match="done with other arguments"):  # another budget, same directory
        stages.stage(tmp_path, lambda argv: 0, ["optim.epochs=5"])
    yml = tmp_path / "stage.yaml"
    yml.write_text("optim:\n  lr: 0.001  # a comment\n")
    assert stages.stage(tmp_path / "y", lambda argv: 0, ["--config", str(yml)]) >= 0
    yml.write_text("# reworded comment\noptim: {lr: 0.001}\n")  # the same settings: still done
    assert stages.stage(tmp_path / "y", lambda argv: 0, ["--config", str(yml)]) >= 0
    yml.write_text("optim:\n  lr: 0.002\n")
    with pytest.raises(stages.StageError, match=r"done with other settings in .*stage\.yaml"):
        stages.stage(tmp_path / "y", lambda argv: 0, ["--config", str(yml)])
    done = tmp_path / "y" / "DONE"
    done.write_text(json.dumps({k: v for k, v in json.loads(done.read_text()).items() if k != "config"}))
    assert stages.stage(tmp_path / "y", lambda argv: 0, ["--config", str(yml)]) >= 0, "DONE before fingerprints"
    with pytest.raises(stages.StageError, match="failed"):
        stages.stage(tmp_path / "x", lambda argv: 1, [])
    assert not (tmp_path / "x" / "DONE").exists() and not (tmp_path / "x" / "LOCK").exists()


PROBE_STAGE = """import os, signal, sys, time
from pathlib import Path
out, got = Path(sys.argv[1]), []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
(out / "threads").write_text(os.environ.get("OMP_NUM_THREADS", ""))
(out / "ready").write_text("")
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # a second delivery would land here
(out / "signals").write_text(str(len(got)))
sys.exit(143 if got else 3)
"""


def test_a_stage_runs_in_process_in_float32_and_as_its_own_process_at_another_precision(tmp_path, monkeypatch):
    """by_precision: the study's fp32 stages call their main here (one Accelerate precision per process, the default
    one), a stage at another precision (the GPU study's bf16) gets a process of its own."""
    config = tmp_path / "c.yaml"
    config.write_text("run: {mixed_precision: bf16}\n")
    assert stages.stage_precision(["--config", str(config)]) == "bf16"
    assert stages.stage_precision(["--config", str(config), "run.mixed_precision=no"]) == "no"
    assert stages.stage_precision(["run.mixed_precision=bf16", "x=1"]) == "bf16"
    assert stages.stage_precision(["x=1"]) == "no"
    started: list[list[str]] = []
    monkeypatch.setattr(stages, "_run_process", lambda command: started.append(command) or 0)
    module = tmp_path / "fake_stage_module.py"
    module.write_text("CALLS = []\ndef main(argv):\n    CALLS.append(argv)\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = stages.by_precision("fake_stage_module")
    assert run(["a=1"]) == 0 and run(["run.mixed_precision=bf16"]) == 0
    import fake_stage_module

    assert fake_stage_module.CALLS == [["a=1"]]
    assert started == [[sys.executable, "-m", "fake_stage_module", "run.mixed_precision=bf16"]]


def test_study_merges_earlier_results_at_the_same_budget_only(tmp_path, capsys):
    """Seeds accumulate: rows of an earlier results file (another machine, runs/ cleaned) join the rows measured
    now; measured rows win; another budget, another harness or a row pretrained for other epochs is not merged."""
    cfg = pipeline_config.load(StudyConfig, None, [f"runs={tmp_path / 'runs'}", f"results={tmp_path}",
                                                   "row_pretrain_epochs={stop: 1.0}"])
    earlier = {"harness": HARNESS_VERSION, "config": dataclasses.asdict(cfg),
               "commands": ["python pipelines/study.py seeds=[0]"],
               "results": {"supervised": [{"seed": 0, "top1": 0.5}, {"seed": 1, "top1": 0.6}],
                           "mp3": [{"seed": 0, "top1": 0.7, "pretrain_epochs": 0.5}],
                           "stop": [{"seed": 0, "top1": 0.6, "pretrain_epochs": 0.5}]}}
    (tmp_path / "study.json").write_text(json.dumps(earlier))
    rows = collect(Study(cfg))
    assert commands_so_far(cfg, ["seeds=[1]"]) == ["python pipelines/study.py seeds=[0]",
                                                   "python pipelines/study.py seeds=[1]"]
    assert commands_so_far(cfg, ["--report-only"]) == earlier["commands"]
    assert [m["seed"] for m in rows["supervised"]] == [0, 1] and rows["mp3"][0]["top1"] == 0.7
    assert rows["mp3"][0]["source"] == str(tmp_path / "study.json")
    assert "stop" not in rows, "pretrained 0.5 epoch, this study pretrains StoP for 1"

    del earlier["harness"]  # no harness version recorded: not merged
    (tmp_path / "study.json").write_text(json.dumps(earlier))
    assert collect(Study(cfg)) == {}
    assert "harness differ" in capsys.readouterr().out
    earlier["harness"] = HARNESS_VERSION
    earlier["config"]["pretrain_epochs"] = 5.0  # measured at another budget: not merged
    (tmp_path / "study.json").write_text(json.dumps(earlier))
    assert collect(Study(cfg)) == {}
    assert "pretrain_epochs differ" in capsys.readouterr().out
    assert commands_so_far(cfg, ["seeds=[1]"]) == ["python pipelines/study.py seeds=[1]"]


def test_holm_keeps_two_of_v3s_fourteen_tested_comparisons():
    """Holm's step-down adjustment: the k-th smallest p times (m - k + 1), monotone, capped at 1; on the 14
    comparisons v3 tested (raw p as its report printed them) it keeps MP3 Fig. 3 train-0 and MJP Table 1 only."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []
    v3 = {"MP3 Table 4": 0.045, "MP3 Fig. 3 train 0": 0.0011, "MP3 Fig. 3 0.75 vs 0": 0.016, "MP3 Fig. 6": 0.37,
          "DropPos Table 1": 0.012, "DropPos Table 3 position": 0.16, "DropPos Table 3 probe": 0.58,
          "DropPos Table 4": 0.19, "MJP Table 1": 0.0038, "RandSAC Table 2": 0.083, "RandSAC Table 5": 0.52,
          "RandSAC Table 7": 0.9, "MP3 Table 5": 0.039, "speech null control": 0.7}
    kept = [name for name, adjusted in zip(v3, holm(list(v3.values())), strict=True) if adjusted < 0.05]
    assert kept == ["MP3 Fig. 3 train 0", "MJP Table 1"]


def test_the_gate_is_a_one_sided_welch_test_on_validation_that_fails_closed():
    """Learned: the validation probe above the random init of the same feature (same seeds) by a one-sided Welch
    t-test at 0.05 over >= 3 seeds (checked against scipy); fewer seeds or no gate numbers: not learned; judged at
    the budget (pretraining epochs) asked, by default the row's own."""
    from scipy.stats import ttest_ind

    def row(seed: int, probes: dict[str, float], random: float, top: float) -> dict:
        return {"seed": seed, "pretrain_epochs": 1.0, "linear_probe": top,
                "gate": {"probe": probes, "random": random, "random_init": "sincos2d/patch_mean", "pixels": 0.8}}

    randoms = [0.60, 0.61, 0.60]
    rows = {"stop": [row(s, {"0.5": 0.60 + 0.005 * s, "1": 0.66 + 0.01 * s}, randoms[s], 0.65)
                     for s in range(3)],
            "ijepa": [row(s, {"0.5": 0.70 + 0.01 * s, "1": 0.72 + 0.01 * s}, randoms[s], 0.70 + 0.001 * s)
                      for s in range(3)]}
    judged = gate(rows, "stop", "1")
    p = ttest_ind([0.66, 0.67, 0.68], randoms, equal_var=False, alternative="greater").pvalue
    assert judged.passed and judged.p == pytest.approx(p) and "one-sided Welch p" in judged.text
    assert not gate(rows, "stop", "0.5").passed, "at 0.5 epoch StoP does not beat its random init"
    assert gate(rows, "ijepa").passed, "default: the row's own pretraining epochs"
    short = {"stop": rows["stop"][:2]}
    assert not gate(short, "stop", "1").passed and "2 seed(s)" in gate(short, "stop", "1").text
    merged = {"stop": [{"seed": s, "linear_probe": 0.9, "pretrain_epochs": 1.0} for s in range(3)]}
    assert not gate(merged, "stop").passed and "gate not measured" in gate(merged, "stop").text


def test_skip_leaves_rows_out_of_their_groups_and_refuses_main_rows():
    from patchplace.research.reproduction.plan import runs_of

    cfg = pipeline_config.load(StudyConfig, None, ["skip=[mp3_eta0.75]"])
    assert [r.name for r in runs_of(("mp3_eta", "droppos"), cfg.only, cfg.skip)] == ["mp3_eta0", "droppos_sigma0"]
    for bad, message in (("skip=[mp3]", "main rows are the study's table"), ("skip=[nope]", "unknown run")):
        with pytest.raises(pipeline_config.ConfigError, match=message):
            pipeline_config.load(StudyConfig, None, [bad])


def test_a_stage_finished_in_a_resumed_attempt_is_flagged(tmp_path):
    """Its DONE records the last attempt's seconds only; the report marks it (two start-ups in its log)."""
    from patchplace.pipelines.stages import stage_resumed

    for name, startups in (("once", [3.0, 3.0]), ("twice", [3.0, 2.5]), ("unfinished", [3.0, 2.5])):
        d = tmp_path / name
        d.mkdir()
        (d / "log.jsonl").write_text("".join(json.dumps({"step": i, "loss": 1.0, "startup_s": s}) + "\n"
                                             for i, s in enumerate(startups)))
        if name != "unfinished":
            (d / "DONE").write_text(json.dumps({"seconds": 1.0, "argv": []}))
    assert [stage_resumed(tmp_path / n) for n in ("once", "twice", "unfinished")] == [False, True, False]


def test_unit_per_row_plans_a_unit_per_row_and_seed():
    """unit_per_row (finer units keep every --jobs process busy): one unit per (row, seed) in the priority order of
    groups, then seed, then the group's rows; only / skip / close_rows respected."""
    from patchplace.research.reproduction.plan import run_seeds, runs_of

    cfg = pipeline_config.load(StudyConfig, None, ["unit_per_row=true", "seeds=[0,1]", "ablation_seeds=[0,1,2]",
                                                   "speech_seeds=[0]", "skip=[mp3_eta0.75]",
                                                   "close_rows=[droppos_sigma0]", "close_seeds=[0,1,2,3]"])
    units = study.study_units(cfg)
    rows = [(name, u.seed) for u in units for name in u.only]
    expected = [(r.name, s) for g in GROUPS for r in runs_of((g,), (), cfg.skip) for s in run_seeds(cfg, r)]
    assert sorted(rows) == sorted(expected) and len(rows) == len(set(rows)), "every (row, seed) exactly once"
    assert ("droppos_sigma0", 3) in rows and ("mp3_eta0", 3) not in rows, "close_seeds for the close rows only"
    assert all(len(u.only) == 1 for u in units)
    order = {r.name: i for i, r in enumerate(RUNS)}
    keys = [(cfg.groups.index(u.groups[0]), u.seed, order[u.only[0]]) for u in units]
    assert keys == sorted(keys), "priority: groups, then seed, then the group's rows"
    assert units[0].overrides() == ["groups=[main]", "only_seeds=[0]", "only=[supervised]"]
    assert str(units[0]) == "main supervised seed 0", "as --jobs names it in its queue"
    only = study.study_units(dataclasses.replace(cfg, only=("mae",)))
    assert only == [study.Unit(("main",), 0, ("mae",)), study.Unit(("main",), 1, ("mae",))]
    with pytest.raises(pipeline_config.ConfigError, match="unknown run"):
        pipeline_config.load(StudyConfig, None, ["only=[controls]"])


@pytest.mark.slow
def test_a_per_row_study_in_jobs_runs_each_row_in_a_process_of_its_own(shards, tmp_path, capsys):
    """unit_per_row through --jobs: two row units of one seed, each run by a process of its own in the shared
    runs/, leave both rows on that seed."""
    args = [f"runs={tmp_path / 'runs'}", f"results={tmp_path / 'results'}", "preset=vit_micro", "batch_size=8",
            "pretrain_epochs=0.25", "num_workers=0", f"fashion_mnist={shards / 'img'}", "groups=[mp3_eta]",
            "probe_only=[mp3_eta]", "ablation_seeds=[0]", "unit_per_row=true", "probe_train_samples=16",
            "probe_val_samples=16", "probe_epochs=1", "curve_samples=8", "holdout=12", "gate=false",
            "test_samples=16", "threads=1"]
    assert study.main(["--jobs", "2", *args]) == 0
    out = capsys.readouterr().out
    assert ("2 units (mp3_eta mp3_eta0.75 seed 0, mp3_eta mp3_eta0 seed 0) over 2 processes, 1 thread(s) "
            "each") in out, out
    assert sorted(p.name for p in (tmp_path / "runs").glob("job*.log")) == ["job0.log", "job1.log"]
    assert {run: [m["seed"] for m in ms] for run, ms in measured(args).items()} == {
        "mp3_eta0.75": [0], "mp3_eta0": [0]}


@pytest.mark.slow
def test_the_gate_probes_validation_and_row_seeds_add_seeds(shards, tmp_path):
    """The learned gate's stage probes the final checkpoint on the validation split beside the same seed's random
    init; ``close_rows`` run ``close_seeds``, ``row_pretrain_epochs`` lengthens its pretraining; the MP3 eta curve
    has eval eta 0.55."""
    args = [f"runs={tmp_path / 'runs'}", f"results={tmp_path / 'results'}", "preset=vit_micro",
            "pretrain_epochs=0.25", "batch_size=8", "num_workers=0", f"fashion_mnist={shards / 'img'}",
            "groups=[main,mp3_eta]", "only=[stop,mp3_eta0]", "full_label_rows=[supervised]",
            "first_seed_finetunes=false", "probe_only=[mp3_eta]", "close_rows=[stop]", "close_seeds=[0,1]",
            "row_pretrain_epochs.stop=0.5", "holdout=12", "gate_val_samples=12", "probe_train_samples=32",
            "probe_val_samples=32", "probe_epochs=2", "test_samples=32", "curve_samples=16", "seeds=[0]",
            "ablation_seeds=[0]", "overrides=[data.shuffle_buffer=16]"]
    assert study.main(args) == 0
    rows = measured(args)
    assert [m["seed"] for m in rows["stop"]] == [0, 1] and [m["seed"] for m in rows["mp3_eta0"]] == [0]
    for m in rows["stop"]:
        assert m["pretrain_epochs"] == 0.5 and set(m["gate"]["probe"]) == {"0.5"}
        assert m["gate"]["val_samples"] == 12 and m["gate"]["random_init"] == "sincos2d/patch_mean"
    eta0 = rows["mp3_eta0"][0]
    assert set(eta0["gate"]["probe"]) == {"0.25"} and "0.55" in eta0["mp3_eta_curve"]
    gate = json.loads((tmp_path / "runs" / "seed0" / "stop" / "gate" / "controls.json").read_text())
    assert gate["test_split"] == "holdout" and gate["seeds"] == [0], "the gate reads validation, on the row's seed"
