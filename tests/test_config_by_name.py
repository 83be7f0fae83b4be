"""--config NAME from any folder: an existing file first, else the shipped config of that name (``.yaml`` optional,
from the installed package: a wheel carries them); neither is one line listing the shipped names. And the demo's
--help needs no ONNX Runtime: its export stages import it when they run, and a missing one is one installable line."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from patchplace.pipelines.config import ConfigError, config_path, load
from patchplace.pipelines.pretrain import PretrainConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "pipelines" / "configs"


def data(shards: Path) -> list[str]:
    """The shipped config's shards are relative to the repository: the test shards instead."""
    return [f"data.train={shards / 'img' / 'train'}", f"data.val={shards / 'img' / 'test'}"]


@pytest.mark.parametrize("name", ["mp3_fashion_mnist.yaml", "mp3_fashion_mnist"])
def test_a_shipped_config_loads_by_name_from_another_folder(name, shards, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_path(name).resolve() == CONFIGS / "mp3_fashion_mnist.yaml"
    assert load(PretrainConfig, name, data(shards)) == load(PretrainConfig, str(CONFIGS / "mp3_fashion_mnist.yaml"),
                                                            data(shards))


def test_an_existing_file_comes_before_the_shipped_one_of_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("mp3_fashion_mnist.yaml").write_text("method: mae\n")
    assert config_path("mp3_fashion_mnist.yaml") == Path("mp3_fashion_mnist.yaml")


def test_neither_a_file_nor_a_shipped_name_is_one_line_listing_the_shipped_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("no_such_config", "elsewhere/mp3_fashion_mnist.yaml"):  # a path is the user's, not a name
        with pytest.raises(ConfigError) as raised:
            config_path(name)
        message = str(raised.value)
        assert "\n" not in message and name in message
        assert all(p.name in message for p in CONFIGS.glob("*.yaml"))


def test_the_console_script_finds_a_shipped_config_by_name(tmp_path):
    script = Path(sys.executable).with_name("patchplace-pretrain")
    assert script.is_file(), f"{script}: the console script is not installed (make test installs pipelines/)"
    done = subprocess.run([str(script), "--config", "mp3_fashion_mnist", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(from file)" in done.stdout, "the help shows the shipped file's values"


@pytest.mark.slow
def test_the_wheel_ships_the_configs_and_finds_them_by_name(tmp_path):
    """The pipelines wheel (built offline) holds the configs, and its patchplace.pipelines resolves a name to them."""
    from test_install import build_wheel

    wheel = build_wheel("./pipelines", tmp_path / "wheel")
    assert {f"patchplace/pipelines/configs/{p.name}" for p in CONFIGS.glob("*.yaml")} <= set(wheel.namelist())
    site = tmp_path / "site"
    zipfile.ZipFile(wheel.filename).extractall(site)
    found = subprocess.run([sys.executable, "-c", "from patchplace.pipelines.config import config_path; "
                            "print(config_path('mp3_fashion_mnist').resolve())"],
                           cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""}, capture_output=True, text=True,
                           timeout=300)
    assert found.returncode == 0, found.stderr[-2000:]
    assert Path(found.stdout.strip()) == site / "patchplace" / "pipelines" / "configs" / "mp3_fashion_mnist.yaml"


WITHOUT_ORT = "import sys; sys.modules['onnxruntime'] = None; from patchplace.pipelines import demo; "


def test_the_demo_help_needs_no_onnx_runtime_and_running_without_it_is_one_installable_line(tmp_path):
    helped = subprocess.run([sys.executable, "-c", WITHOUT_ORT + "sys.exit(demo.main(['--help']))"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "--ort-robustness-limit" in helped.stdout, helped.stderr[-2000:]
    ran = subprocess.run([sys.executable, "-c", WITHOUT_ORT + "sys.exit(demo.main(['--out', 'demo']))"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 1 and ran.stderr.strip().count("\n") == 0, ran.stderr[-2000:]
    assert "pip install onnxruntime" in ran.stderr and "patchplace-export[" not in ran.stderr
    assert not (tmp_path / "demo").exists(), "said before any stage ran"
