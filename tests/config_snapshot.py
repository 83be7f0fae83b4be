"""Every shipped config (pipelines/configs/*.yaml) parsed by every config class of the command lines: the values
each gives (or the one line it is refused with), as JSON. ``python tests/config_snapshot.py OUT.json`` writes it;
tests/test_config_snapshot.py compares it with the stored one (a config's values must not change with the loader)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "pipelines" / "configs"


def classes() -> dict[str, type]:
    from patchplace.pipelines.commands import EvaluateConfig, FinetuneConfig, PretrainConfig
    from patchplace.research.reproduction.plan import StudyConfig

    return {"pretrain": PretrainConfig, "finetune": FinetuneConfig, "evaluate": EvaluateConfig, "study": StudyConfig}


def _plain(value: Any) -> Any:
    """JSON of a value with its Python type kept (1 and 1.0 and True differ)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [type(value).__name__, *map(_plain, value)]
    return [type(value).__name__, value if isinstance(value, bool | int | float | str | None) else repr(value)]


def snapshot() -> dict[str, Any]:
    """{config file: {class: parsed values, or the error line}} (built, not validated: datasets may be absent)."""
    from patchplace.pipelines.config import build, given_values

    out: dict[str, Any] = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        for name, cls in classes().items():
            try:
                file, given = given_values(cls, str(path), [])
                out[f"{path.name} {name}"] = _plain(build(cls, {**file, **given}))
            except Exception as exc:  # the refusal is part of the snapshot
                out[f"{path.name} {name}"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(snapshot(), indent=1, sort_keys=True))
