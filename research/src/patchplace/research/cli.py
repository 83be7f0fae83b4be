"""The research command lines without torch: their parsers and the controls' config classes, so that ``--help`` and
a usage error (exit 2) answer in a fraction of a second, and the entry that imports a command (torch, timm,
accelerate) only once its arguments parse. Each command module reads its arguments through the parser here; its
description is its own docstring, read from its source.

    python pipelines/study.py | controls.py | benchmark.py ...       (the scripts: ``main("study")`` ...)
    python -m patchplace.research.study | controls | benchmark ...   (an early ``__main__`` guard in the module
                                                                     hands over to ``main``)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from patchplace.pipelines.cli import description, help_asked
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.help import HelpFormatter, help_epilog, parser
from patchplace.pipelines.sections import DataSection, ModelSection, RunSection

# patchplace.finetune's PROBE_FEATURES (it imports torch); tests/test_help_without_torch.py holds the two equal
PROBE_FEATURES = ("cls", "mean", "patch_mean")
MODULES = {"study": "patchplace.research.study", "controls": "patchplace.research.controls",
           "benchmark": "patchplace.research.benchmark"}


# ---------------------------------------------------------------------------------------------- controls
@dataclass
class ControlsSection:
    """What the controls are computed on."""

    seeds: tuple[int, ...] = (0, 1, 2)  # one random-init backbone and one probe initialisation per seed
    label_fractions: tuple[float, ...] = (0.01, 0.1)  # class-balanced subsets of the whole train split
    probe_train_samples: int = 5000  # the all-label probe set: the first N train images (as evaluate.py)
    probe_epochs: int = 100  # epochs of each linear probe (as the study's)
    knn_k: int = 20  # neighbours of the kNN (cosine, DINO's weighting)
    # the random-init controls, each "[pos_embed/]feature": a random-init model.preset with that PE (default: the
    # preset's) probed on that feature — mean (all tokens) | cls | patch_mean (patch tokens only). A method's probe
    # is read against the random init of its own architecture and feature (e.g. DropPos: sincos2d/cls). The first
    # is also written as the default control (random_linear / random_knn).
    random_inits: tuple[str, ...] = ("mean",)
    random_init: bool = True  # the random-init controls (false: raw pixels and checkpoints only)
    checkpoints: tuple[str, ...] = ()  # also probe these checkpoints (their probe_feature) on the same sets

    def validate(self) -> None:
        if not self.seeds or any(not 0 < f < 1 for f in self.label_fractions) or self.probe_train_samples < 0:
            raise ConfigError("controls.seeds needs a seed, label_fractions must be in (0, 1), "
                              "probe_train_samples >= 0")
        if not self.label_fractions and not self.probe_train_samples:
            raise ConfigError("controls: no set to probe (label_fractions empty and probe_train_samples 0)")
        bad = [v for v in self.random_inits if v.rpartition("/")[2] not in PROBE_FEATURES]
        if not self.random_inits or bad:
            raise ConfigError(f"controls.random_inits: each entry is [pos_embed/]feature with feature one of "
                              f"{PROBE_FEATURES}, e.g. sincos2d/cls; got {list(self.random_inits)}")


@dataclass
class ControlsConfig:
    """``model.preset`` (+ ``model.overrides``) is the backbone whose random initialisation is the control."""

    controls: ControlsSection = field(default_factory=ControlsSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=lambda: ModelSection(preset="vit_cpu_narrow"))
    run: RunSection = field(default_factory=lambda: RunSection(output="results/controls"))

    @staticmethod
    def help_fields(argv: list[str], config: ControlsConfig, sources: dict[str, str]) -> list[str]:
        return ["--study STUDY.json: also read that study's probes (its results) against the random-init control"]


def split_study(argv: list[str]) -> tuple[Path | None, list[str]]:
    """(the ``--study STUDY.json`` of the controls' command line, the rest: ``--config`` and the overrides)."""
    if "--study" not in argv:
        return None, argv
    i = argv.index("--study")
    return Path(argv[i + 1]), argv[:i] + argv[i + 2:]


def controls_parser(argv: list[str]) -> argparse.ArgumentParser:
    """``--config`` + overrides of :class:`ControlsConfig` (``argv`` without ``--study``: :func:`split_study`)."""
    return parser(ControlsConfig, description(MODULES["controls"]), argv)


# ---------------------------------------------------------------------------------------------- study
def study_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The study's options; with ``--help`` in ``argv`` its fields with the values this command line runs with."""
    epilog = None
    if help_asked(argv):
        from patchplace.research.reproduction.plan import StudyConfig

        epilog = help_epilog(StudyConfig, argv)
    p = argparse.ArgumentParser(description=description(MODULES["study"]), formatter_class=HelpFormatter,
                                epilog=epilog)
    p.add_argument("--config", help="YAML file (pipelines/configs/study_v5.yaml)")
    p.add_argument("--report-only", action="store_true", help="only (re)write the results from finished runs")
    p.add_argument("--jobs", type=int, default=1, help="study processes sharing the groups (default: 1)")
    p.add_argument("--no-report", action="store_true",
                   help="run the stages only, write no report (--jobs gives each unit's process this: the "
                        "report is written once, when every unit has finished)")
    p.add_argument("overrides", nargs="*", help="field=value, e.g. seeds=[0,1,2] groups=[main]")
    return p


def benchmark_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The benchmark's options (:mod:`patchplace.research.benchmarks.options`: one argument group per suite)."""
    from patchplace.research.benchmarks.options import build_parser

    return build_parser()


PARSERS = {"study": study_parser, "controls": controls_parser, "benchmark": benchmark_parser}


def main(command: str, argv: list[str] | None = None) -> int:
    """``command``'s main on ``argv`` (default: the process's arguments), imported once they parse: ``--help``
    and a usage error exit here (0 and 2) without loading torch."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed = split_study(argv)[1] if command == "controls" else argv
    PARSERS[command](parsed).parse_args(parsed)
    return importlib.import_module(MODULES[command]).main(argv)

