"""A finished (or interrupted) run extended by ``run.resume=true`` with a larger budget, as HF Trainer and timm's
``--resume`` continue a schedule: the steps already taken stay as they were, the schedule is planned again over the
new budget (``optim.extend=replan``) or a new phase starts at the resumed step (``optim.extend=phase``), and
config.yaml's history says so. A smaller budget is refused in one line, every file of the run left as it was."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from pipeline_args import TINY, files_of, img, run_log, small_heads, state_dir

from patchplace.pipelines import pretrain

LR, WARMUP = 1e-3, 0.25


def args(shards, out, steps: int, *extra: str) -> list[str]:
    return ["method=mae", *img(shards), *TINY, *small_heads("mae"), f"optim.max_steps={steps}", f"optim.lr={LR}",
            f"optim.warmup_fraction={WARMUP}", "optim.min_lr_ratio=0.0", f"run.output={out}", *extra]


def cosine(step: int, total: int) -> float:
    """The lr of 0-based step ``step`` of a ``total``-step warm-up + cosine (the engine's default schedule)."""
    warmup = round(WARMUP * total)
    if step < warmup:
        return LR * (step + 1) / warmup
    return LR * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.parametrize("mode", ["replan", "phase"])
def test_a_finished_run_extended_continues_its_schedule_as_asked(shards, tmp_path, mode):
    out = tmp_path / "run"
    assert pretrain.main(args(shards, out, 4)) == 0
    first = run_log(out)
    assert pretrain.main(args(shards, out, 8, "run.resume=true", f"optim.extend={mode}")) == 0
    log = run_log(out)
    assert [r["step"] for r in log] == list(range(1, 9))
    assert log[:4] == first, "the steps already taken stay as they were"
    lrs = [r["lr"] for r in log[4:]]
    planned = [cosine(s, 8) for s in range(4, 8)] if mode == "replan" else [cosine(s, 4) for s in range(4)]
    assert lrs == pytest.approx(planned, rel=1e-6)
    text = (out / "config.yaml").read_text()
    assert text.splitlines()[0] == f"# extended at step 4: optim.max_steps 4 -> 8 (optim.extend={mode})"
    assert yaml.safe_load(text)["optim"]["max_steps"] == 8
    trainer = json.loads((state_dir(out) / "trainer.json").read_text())
    assert trainer["step"] == 8 and trainer["schedule_start"] == (4 if mode == "phase" else 0)


def test_a_smaller_budget_is_refused_and_changes_no_file(shards, tmp_path, capsys):
    out = tmp_path / "run"
    assert pretrain.main(args(shards, out, 4)) == 0
    before = files_of(out)
    capsys.readouterr()
    assert pretrain.main(args(shards, out, 3, "run.resume=true")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "give 3 steps, fewer than the 4 the run was planned for" in errors[0], errors
    assert files_of(out) == before
    assert pretrain.main(args(shards, out, 4, "run.resume=true", "optim.lr=0.5")) == 2  # the rest stays refused
    assert "optim.lr" in capsys.readouterr().err and files_of(out) == before
