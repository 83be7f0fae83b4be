"""One validation pass: pydantic validates a config read from a file and overrides once (:func:`config.build`), the
sections' ``validate()`` then checking only what needs the file system or torch; a section built in code is still
validated by its ``validate()``, with the refusal a file gets."""

from __future__ import annotations

import pytest

from patchplace.pipelines import config
from patchplace.pipelines.commands import FinetuneConfig, PretrainConfig
from patchplace.pipelines.sections import DataSection, OptimSection


def _counting(monkeypatch) -> list[type]:
    seen: list[type] = []
    validated = config._validated

    def counted(cls, *args, **kwargs):
        seen.append(cls)
        return validated(cls, *args, **kwargs)

    monkeypatch.setattr(config, "_validated", counted)
    return seen


@pytest.mark.parametrize("cls", [PretrainConfig, FinetuneConfig])
def test_a_loaded_config_is_validated_once(cls, shards, tmp_path, monkeypatch):
    seen = _counting(monkeypatch)
    images = shards / "img"
    overrides = [f"data.train={images / 'train'}", f"data.val={images / 'test'}", f"run.output={tmp_path / 'run'}"]
    loaded = config.load(cls, None, overrides)
    assert seen.count(cls) == 1 and not {DataSection, OptimSection} & set(seen)
    assert loaded.data.train == str(images / "train")


def test_a_section_built_in_code_is_refused_as_from_a_file(monkeypatch):
    with pytest.raises(config.ConfigError) as from_file:
        config.build(PretrainConfig, {"optim.schedule": "step"})
    seen = _counting(monkeypatch)
    with pytest.raises(config.ConfigError) as in_code:
        OptimSection(schedule="step").validate()
    assert seen == [OptimSection] and str(in_code.value) == str(from_file.value)
