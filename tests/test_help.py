"""--help of every entry point as a user asks for it: exit 0, at most 100 columns on any terminal, nothing run
and nothing written, and with --config the values that command line runs with (the file's, the overrides')."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "pipelines" / "configs"
WIDTH = 100

# python entry points run in-process: (module, its main's --help argv, the config file it reads or None)
PYTHON = [
    ("patchplace.pipelines.pretrain", CONFIGS / "mp3_fashion_mnist.yaml"),
    ("patchplace.pipelines.finetune", CONFIGS / "finetune_fashion_mnist.yaml"),
    ("patchplace.pipelines.evaluate", CONFIGS / "evaluate_fashion_mnist.yaml"),
    ("patchplace.research.controls", CONFIGS / "controls_fashion_mnist.yaml"),
    ("patchplace.research.study", CONFIGS / "study_v5.yaml"),
    ("patchplace.pipelines.demo", None),
    ("patchplace.research.benchmark", None),
    ("patchplace.research.emulated_bf16", None),
    ("patchplace.export.__main__", None),
    ("patchplace.export.evaluate", None),
    ("patchplace.data.__main__", None),
    ("patchplace.models.convert", None),
    *((f"patchplace.pipelines.datasets.{p.stem}", None) for p in sorted((ROOT / "data").glob("*.py"))),
]


def _leaves(raw: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        elif isinstance(value, bool | int | float | str):
            out[f"{prefix}{key}"] = value
    return out


def _check(text: str, where: Path, name: str) -> None:
    lines = text.splitlines()
    assert lines, f"{name}: no help"
    widest = max(lines, key=len)
    assert len(widest) <= WIDTH, f"{name}: {len(widest)} columns: {widest!r}"
    assert list(where.iterdir()) == [], f"{name}: --help wrote {sorted(p.name for p in where.iterdir())}"


@pytest.mark.parametrize(("module", "config"), PYTHON, ids=[m for m, _ in PYTHON])
def test_python_entry_points_help(module, config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")  # a wide terminal: still 100 columns
    main = importlib.import_module(module).main
    argv = ["--help"]
    if config is not None:
        leaves = _leaves(yaml.safe_load(config.read_text()))
        override = "run.seed=7" if not module.endswith("study") else "probe_epochs=7"
        argv = ["--config", str(config), override, "--help"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None), out
    _check(out, tmp_path, module)
    if config is not None:  # the values in force: the file's, marked, and the override's
        shown = [k for k, v in leaves.items() if f"  {k} = {v!r}  (from file)" in out]
        assert shown, f"{module}: no value of {config.name} in its --help"
        assert f"{override.replace('=', ' = ')}  (override)" in out, f"{module}: the override is not shown"


def test_every_entry_point_is_checked():
    scripts = {p.stem for p in (ROOT / "pipelines").glob("*.py")}
    assert scripts <= {m.rsplit(".", 1)[-1] for m, _ in PYTHON}, "a new entry point: add it to PYTHON"


def test_evaluate_help_lists_only_fields_an_evaluation_reads(shards, tmp_path, monkeypatch, capsys):
    """Every field evaluate --help lists is read by an evaluation (training's fields it never reads are named as
    such): reads of the config's fields are traced through two evaluations that take every path of a field, a
    classifier with every part on (probes, label fractions, method curves, --privacy, a hold-out) in memory, and a
    streamed one with the logistic-regression low-label probe. Reads while building, validating or describing the
    config do not count."""
    import re
    import sys
    import typing
    from dataclasses import fields

    from pipeline_args import TINY, img

    from patchplace.pipelines import config, evaluate, pretrain

    checkpoint = tmp_path / "mjp"
    assert pretrain.main(["method=mjp", *img(shards), *TINY, "objective.ratio=0.15",
                          "model.overrides={embed_dim: 128, num_heads: 2}", "optim.max_steps=1",
                          f"run.output={checkpoint}"]) == 0
    read: set[str] = set()

    def counted() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_name
            if name == "validate" or (frame.f_globals.get("__name__") == config.__name__ and name in (
                    "build", "describe")):
                return False
            frame = frame.f_back
        return True

    def traced(section: str, cls: type):
        names = {f.name for f in fields(cls)}

        def getattribute(self, name):
            if name in names and counted():
                read.add(f"{section}.{name}")
            return object.__getattribute__(self, name)

        return getattribute

    for section, cls in typing.get_type_hints(evaluate.EvaluateConfig).items():
        if isinstance(cls, type) and fields(cls):
            monkeypatch.setattr(cls, "__getattribute__", traced(section, cls))
    common = [*img(shards), "data.batch_size=8", "data.num_workers=0", f"model.checkpoint={checkpoint / 'checkpoint'}",
              "eval.probe_train_samples=16", "eval.probe_epochs=1", "eval.max_eval_samples=8"]
    assert evaluate.main(["--privacy", *common, "data.holdout=6", "eval.label_fractions=[0.5]", "privacy.images=2",
                          "privacy.steps=1", f"run.output={tmp_path / 'ev'}"]) == 0
    assert evaluate.main([*common, "data.in_memory=false", "eval.label_probe=logistic",  # StoP's 1% solver
                          f"run.output={tmp_path / 'streamed'}"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        evaluate.main(["--help"])
    listed = set(re.findall(r"^  (\w+\.\w+) = ", capsys.readouterr().out, flags=re.M))
    assert listed and not listed - read, f"evaluate --help lists fields no evaluation reads: {sorted(listed - read)}"
    assert not listed & set(config.unread_fields(evaluate.EvaluateConfig))
