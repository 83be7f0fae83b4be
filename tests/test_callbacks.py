"""The Trainer's loop as callbacks (``engine/callbacks.py``): a caller's callback gets every hook in the documented
order, a checkpoint it asks for is written at that step, and what its ``on_end`` returns is recorded in the final
checkpoint's ``state/trainer.json``; :class:`Callbacks` runs every callback even when one already decided."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pipeline_args import TINY, img, small_heads

from patchplace.pipelines import engine, pretrain


class Recorder(engine.Callback):
    """Records each hook it gets; asks for a checkpoint after step 3 and records a marker at the end."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_start(self, step: int) -> None:
        self.events.append(("start", step))

    def on_step(self, step: int, epoch: int, out: dict[str, Any]) -> bool:
        self.events.append(("step", step, epoch))
        return step == 3

    def on_evaluate(self, step: int, result: dict[str, Any]) -> tuple[bool, bool]:
        self.events.append(("evaluate", step, result.get("top1")))
        return False, False

    def on_checkpoint(self, step: int) -> None:
        self.events.append(("checkpoint", step))

    def on_end(self, step: int, stopped: bool) -> dict[str, Any]:
        self.events.append(("end", step, stopped))
        return {"recorder": "done"}

    def on_close(self) -> None:
        self.events.append(("close",))


def train(argv: list[str], callback: engine.Callback) -> int:
    """pretrain.py's training with a scripted evaluation (top1 = step / 100) and ``callback`` added."""
    cfg, accelerator, data = engine.start(pretrain.PretrainConfig, pretrain.__doc__, argv)
    m = data.manifest
    objective, backbone = pretrain.build_objective(cfg, m.num_classes, int(m.info.get("channels", 1)), m.modality,
                                                   data)
    trainer = engine.Trainer(accelerator, objective, backbone, data, cfg.optim, cfg.run, config=cfg,
                             metadata={"method": cfg.method, **engine.data_metadata(data, cfg.data)},
                             evaluate=lambda model, step: {"top1": step / 100, "count": 32}, command="test",
                             callbacks=[callback])
    return trainer.train(cfg.data.batch_size)[1]


@pytest.mark.slow  # end to end: a real (tiny) run of pretrain.py's training
def test_a_callers_callback_gets_every_hook_in_order(shards, tmp_path: Path):
    """8 steps (one epoch of 8 batches), evaluations at 4 and at the end, periodic checkpoints every 4 steps."""
    out = tmp_path / "run"
    recorder = Recorder()
    args = ["method=mae", *img(shards), *TINY, *small_heads("mae"), "optim.max_steps=8", "run.eval_every=4",
            "run.checkpoint_every=4", f"run.output={out}"]
    assert train(args, recorder) == 0
    steps = [("step", s, 0) for s in range(1, 9)]
    assert recorder.events == [("start", 0), *steps[:3], ("checkpoint", 3), steps[3], ("evaluate", 4, 0.04),
                               ("checkpoint", 4), *steps[4:], ("evaluate", 8, 0.08), ("end", 8, False),
                               ("checkpoint", 8), ("close",)]
    state = next((out / "checkpoints").iterdir()) / "state" / "trainer.json"
    trainer = json.loads(state.read_text())
    assert trainer["step"] == 8 and trainer["recorder"] == "done"
    assert list(trainer)[-1] == "config", "the callbacks' records come before the config"

    # resumed once finished: nothing trains, the callbacks start at the last step and close
    again = Recorder()
    assert train([*args, "run.resume=true"], again) == 0
    assert again.events == [("start", 8), ("close",)]


class Says(engine.Callback):
    def __init__(self, checkpoint: bool, stop: bool, seen: list[str], name: str) -> None:
        self.checkpoint, self.stop, self.seen, self.name = checkpoint, stop, seen, name

    def on_step(self, step: int, epoch: int, out: dict[str, Any]) -> bool:
        self.seen.append(self.name)
        return self.checkpoint

    def on_evaluate(self, step: int, result: dict[str, Any]) -> tuple[bool, bool]:
        self.seen.append(self.name)
        return self.checkpoint, self.stop

    def on_end(self, step: int, stopped: bool) -> dict[str, Any]:
        return {self.name: step}


def test_callbacks_ask_all_and_decide_by_any():
    seen: list[str] = []
    both = engine.Callbacks([Says(True, False, seen, "a"), Says(False, True, seen, "b")])
    assert both.on_step(1, 0, {}) is True and seen == ["a", "b"], "the second runs though the first decided"
    assert both.on_evaluate(1, {}) == (True, True) and seen == ["a", "b", "a", "b"]
    assert both.on_end(2, False) == {"a": 2, "b": 2}
    assert engine.Callbacks([]).on_evaluate(1, {}) == (False, False)
