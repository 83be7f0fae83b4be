"""Checkpoints: ``config.json`` + ``model.safetensors``, written atomically; loading never unpickles.

``config.json`` holds the backbone config plus free-form ``metadata`` the pipelines fill in (normalization
statistics, class names, data manifest fingerprint, training provenance).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .backbone import Backbone, build_backbone
from .config import BackboneConfig
from .errors import ModelError

FORMAT = "patchplace.models/1"
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_pretrained(model: Backbone, directory: str | os.PathLike, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``directory/config.json`` and ``directory/model.safetensors`` (temp dir + rename)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the checkpoint from the user's group
    try:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": FORMAT})
        os.chmod(tmp / WEIGHTS_NAME, 0o666 & ~_umask())  # safetensors creates it 0600
        config = {"format": FORMAT, "backbone": model.config.to_dict(), "metadata": metadata or {}}
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        old = None
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def read_config(directory: str | os.PathLike) -> tuple[BackboneConfig, dict[str, Any]]:
    """The backbone config and metadata of a checkpoint directory."""
    directory = Path(directory)
    if directory.suffix in PICKLE_SUFFIXES or (directory.is_dir() and not (directory / CONFIG_NAME).exists()
                                               and any(p.suffix in PICKLE_SUFFIXES for p in directory.iterdir())):
        raise ModelError(f"refusing to load {directory}: pickle checkpoints (.pt/.pth) can run code when loaded; "
                         "save it with save_pretrained() (config.json + model.safetensors) and load that")
    file = directory / CONFIG_NAME
    if not file.is_file():
        raise ModelError(f"no {CONFIG_NAME} in {directory}: expected a save_pretrained() directory")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{file} is not valid JSON ({exc})") from exc
    if raw.get("format") != FORMAT or "backbone" not in raw:
        raise ModelError(f"{file} is not a patchplace checkpoint config (format {raw.get('format')!r}, "
                         f"expected {FORMAT!r})")
    return BackboneConfig.from_dict(raw["backbone"]), raw.get("metadata", {})


def load_pretrained(directory: str | os.PathLike, map_location: str | torch.device = "cpu"
                    ) -> tuple[Backbone, dict[str, Any]]:
    """Rebuild the backbone of a ``save_pretrained`` directory; returns (model, metadata)."""
    config, metadata = read_config(directory)
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise ModelError(f"no {WEIGHTS_NAME} in {directory}: the checkpoint is incomplete")
    model = build_backbone(config)
    try:
        state = load_file(str(weights), device=str(map_location))
    except SafetensorError as exc:
        raise ModelError(f"{weights} is not a readable safetensors file ({exc}); a pickle (.pt) renamed to "
                         f"{WEIGHTS_NAME}? Re-save the model with save_pretrained()") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"{weights} does not match its config.json: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    return model.to(map_location), metadata
