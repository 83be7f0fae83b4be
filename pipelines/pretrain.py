"""Pretrain a backbone with one of the methods, on WebDataset shards, with Accelerate.

    accelerate launch pipelines/pretrain.py --config pipelines/configs/mp3_fashion_mnist.yaml [section.field=value ...]
    python pipelines/pretrain.py --config pipelines/configs/mp3_fashion_mnist.yaml optim.epochs=0.1

Methods: mp3, mp3_speech, droppos, mae, ijepa, stop, randsac, mjp, supervised. MJP is a supervised training
recipe (jigsaw + unknown PE + DAL, with labels); it runs here, from scratch, like ``supervised``. The backbone
(``checkpoint/``) is what ``finetune.py`` and ``evaluate.py`` start from.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from config import ConfigError, DataSection, ModelSection, OptimSection, RunSection, describe
from engine import (
    USER_ERRORS,
    Data,
    Trainer,
    check_inputs,
    command_line,
    data_metadata,
    start,
)

from patchplace.models import create_model, load_pretrained
from patchplace.objectives import (
    IJEPA,
    MAE,
    MJP,
    MP3,
    DropPos,
    DropPosConfig,
    IJEPAConfig,
    MAEConfig,
    MJPConfig,
    MP3Config,
    RandSAC,
    RandSACConfig,
    Supervised,
    SupervisedConfig,
)

# method -> (objective class, config class, config defaults, backbone PE mode, needs a classifier head)
METHODS: dict[str, tuple[type, type, dict[str, Any], str, bool]] = {
    "mp3": (MP3, MP3Config, {}, "none", False),
    "mp3_speech": (MP3, MP3Config, {"eta": 0.0, "anchor_ratio": 0.05}, "sincos1d", False),
    "droppos": (DropPos, DropPosConfig, {}, "sincos2d", False),
    "mae": (MAE, MAEConfig, {}, "sincos2d", False),
    "ijepa": (IJEPA, IJEPAConfig, {}, "sincos2d", False),
    "stop": (IJEPA, IJEPAConfig, {"stop": True}, "sincos2d", False),
    "randsac": (RandSAC, RandSACConfig, {}, "sincos2d", False),
    "mjp": (MJP, MJPConfig, {}, "learned", True),
    "supervised": (Supervised, SupervisedConfig, {}, "learned", True),
}


@dataclass
class PretrainConfig:
    """``method`` picks the objective; ``objective`` holds its config fields (paper defaults otherwise)."""

    method: str = "mp3"  # mp3 | mp3_speech | droppos | mae | ijepa | stop | randsac | mjp | supervised
    objective: dict[str, Any] = field(default_factory=dict)  # the method's fields (listed below), e.g. {eta: 0.5}
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1.5e-3, betas=(0.9, 0.95)))
    run: RunSection = field(default_factory=lambda: RunSection(output="runs/pretrain"))

    @staticmethod
    def help_fields(argv: list[str]) -> list[str]:
        """--help: the objective fields of the method this command line picks (``method=``, else its
        ``--config``'s, else mp3), with the method's defaults and what each field means."""
        method = next((a.split("=", 1)[1] for a in argv if a.startswith("method=")), None)
        if method is None and "--config" in argv[:-1]:
            try:
                method = (yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()) or {}).get("method")
            except OSError:
                method = None
        method = method if method in METHODS else "mp3"
        _, config_cls, defaults, _, _ = METHODS[method]
        return [f"objective fields of method={method} (objective.field=value; another method: method=<name> "
                "--help):", *describe(config_cls.from_dict(defaults), "objective.")]

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} is not one of {sorted(METHODS)}")
        _, config_cls, defaults, _, _ = METHODS[self.method]
        config_cls.from_dict({**defaults, **self.objective})  # unknown / out-of-range fields fail here


def build_objective(cfg: PretrainConfig, num_classes: int, in_chans: int, modality: str, data: Data | None = None):
    """Backbone (preset + overrides, PE mode of the method) and the objective around it; with ``data``, the
    backbone is first checked against what the reader yields."""
    objective_cls, config_cls, defaults, pos_embed, needs_head = METHODS[cfg.method]
    if cfg.model.checkpoint:
        backbone, _ = load_pretrained(cfg.model.checkpoint)
        source = f"model.checkpoint={cfg.model.checkpoint}"
    else:
        overrides = {"pos_embed": pos_embed, "num_classes": num_classes if needs_head else 0,
                     **({"in_chans": in_chans} if modality == "image" else {}), **cfg.model.overrides}
        backbone = create_model(cfg.model.preset, **overrides)
        source = f"model.preset={cfg.model.preset}"
    if data is not None:
        check_inputs(backbone, data, source)
    return objective_cls(backbone, config_cls.from_dict({**defaults, **cfg.objective})), backbone


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, accelerator, data = start(PretrainConfig, __doc__, argv)
        m = data.manifest
        objective, backbone = build_objective(cfg, m.num_classes, int(m.info.get("channels", 1)), m.modality, data)
        metadata = {"method": cfg.method, "objective": cfg.objective, **data_metadata(data, cfg.data)}
        trainer = Trainer(accelerator, objective, backbone, data, cfg.optim, cfg.run, metadata=metadata, config=cfg,
                          command=command_line(__file__, argv))
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _, code = trainer.train(cfg.data.batch_size)
    if code:
        return code
    if accelerator.is_main_process:
        print(f"checkpoint: {cfg.run.output}/checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
