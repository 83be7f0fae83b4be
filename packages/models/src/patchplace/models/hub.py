"""Checkpoints: ``config.json`` + ``model.safetensors`` (+ ``README.md``), written atomically; loading never
unpickles.

``config.json`` holds the backbone config plus free-form ``metadata`` the pipelines fill in (normalization
statistics, class names, data manifest fingerprint, recipe, metrics), and the fields timm and the Hugging Face Hub
read: ``architecture`` + ``model_args`` + ``pretrained_cfg`` (``timm.create_model("local-dir:DIR",
pretrained=True)``), ``num_classes``, ``label_names`` / ``id2label``. ``model.safetensors`` is keyed as timm's
model of the same architecture (:func:`~patchplace.models.timm_interop.timm_layout`: ``pos_embed``, BEiT's
``q_bias`` / ``v_bias``), so ``pretrained_cfg_overlay=dict(file=...)`` and ``checkpoint_path=`` load it strictly;
the MJP unknown PE, which timm has no slot for, goes to ``extras.safetensors``. The safetensors header carries the
backbone config and the layout, enough to rebuild the model without ``config.json``. Backbones without a timm
equivalent (audio, relbias2d without a class token) keep our names and an ``architecture`` that timm refuses by
name. ``README.md`` is a model card (:mod:`patchplace.models.card`).
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
from .card import model_card
from .config import BackboneConfig
from .errors import ModelError
from .timm_interop import (
    TIMM_ARCHITECTURES,
    from_timm_state_dict,
    split_extras,
    timm_layout,
    timm_model_args,
    to_timm_state_dict,
)

FORMAT = "patchplace.models/1"
CONFIG_NAME, WEIGHTS_NAME, CARD_NAME = "config.json", "model.safetensors", "README.md"
EXTRAS_NAME = "extras.safetensors"  # parameters timm has no slot for (the MJP unknown PE)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_pretrained(model: Backbone, directory: str | os.PathLike, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``directory/{config.json, model.safetensors, README.md}`` (+ ``extras.safetensors``) through a temp
    dir + rename. Absolute paths in ``metadata`` are reduced to their last component (a checkpoint is shared)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    metadata = _without_local_paths(metadata or {})
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the checkpoint from the user's group
    try:
        layout = timm_layout(model.config)
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        if layout != "patchplace":
            state = {k: v.contiguous().cpu() for k, v in to_timm_state_dict(model).items()}
            _, extras = split_extras(model.state_dict())
            if extras:
                save_file({k: v.detach().contiguous().cpu() for k, v in extras.items()}, str(tmp / EXTRAS_NAME))
        header = {"format": FORMAT, "layout": layout, "backbone": json.dumps(model.config.to_dict())}
        save_file(state, str(tmp / WEIGHTS_NAME), metadata=header)
        config = {"format": FORMAT, "backbone": model.config.to_dict(), "metadata": metadata,
                  **hub_fields(model.config, metadata, layout)}
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / CARD_NAME).write_text(model_card(model, metadata, layout))
        for file in tmp.iterdir():
            os.chmod(file, 0o666 & ~_umask())  # safetensors creates its files 0600
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


def hub_fields(config: BackboneConfig, metadata: dict[str, Any], layout: str) -> dict[str, Any]:
    """The ``config.json`` fields timm (``local-dir:`` / ``hf-hub:``) and the Hub read."""
    classes = metadata.get("classes") or []
    fields: dict[str, Any] = {"num_classes": config.num_classes, "num_features": config.embed_dim,
                              "global_pool": "token" if config.global_pool == "cls" else "avg"}
    if classes and len(classes) == config.num_classes:
        fields.update(label_names=list(classes), id2label={str(i): c for i, c in enumerate(classes)},
                      label2id={c: i for i, c in enumerate(classes)})
    if layout == "patchplace":  # timm refuses this name with "Unknown model (...)": never a silently wrong model
        fields["architecture"] = f"patchplace_{config.modality}_{config.pos_embed}_has_no_timm_equivalent"
        return fields
    norm = metadata.get("normalization") or {}
    channels = config.in_chans
    h, w = config.image_hw
    fields.update(architecture=TIMM_ARCHITECTURES[layout], model_args=timm_model_args(config), pretrained_cfg={
        "input_size": [channels, h, w], "fixed_input_size": True, "num_classes": config.num_classes,
        "interpolation": "bicubic", "crop_pct": 1.0, "crop_mode": "center",
        "mean": list(norm.get("mean", [0.5] * channels)), "std": list(norm.get("std", [0.5] * channels)),
        "first_conv": "patch_embed.proj", "classifier": "head"})
    # (padding, e.g. Fashion-MNIST 28 -> 32 px, is ours: metadata.pad_to; timm's PretrainedCfg has no field for it)
    return fields


def _without_local_paths(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_local_paths(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_local_paths(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return Path(value).name
    return value


def update_metadata(directory: str | os.PathLike, **fields: Any) -> None:
    """Add ``fields`` (e.g. the metrics measured after the checkpoint was written) to a checkpoint's metadata and
    rewrite its model card; each file is replaced atomically."""
    directory = Path(directory)
    config, metadata = read_config(directory)
    model = build_backbone(config)  # the card needs the config and parameter count, not the weights
    metadata = _without_local_paths({**metadata, **fields})
    raw = json.loads((directory / CONFIG_NAME).read_text())
    raw["metadata"] = metadata
    raw.update(hub_fields(model.config, metadata, timm_layout(model.config)))
    for name, text in ((CONFIG_NAME, json.dumps(raw, indent=2) + "\n"),
                       (CARD_NAME, model_card(model, metadata, timm_layout(model.config)))):
        part = directory / f".{name}.partial"
        part.write_text(text)
        os.replace(part, directory / name)


def read_config(directory: str | os.PathLike) -> tuple[BackboneConfig, dict[str, Any]]:
    """The backbone config and metadata of a checkpoint directory."""
    directory = Path(directory)
    if directory.suffix in PICKLE_SUFFIXES or (directory.is_dir() and not (directory / CONFIG_NAME).exists()
                                               and any(p.suffix in PICKLE_SUFFIXES for p in directory.iterdir())):
        raise ModelError(f"refusing to load {directory}: pickle checkpoints (.pt/.pth) can run code when loaded; "
                         "save it with save_pretrained() (config.json + model.safetensors) and load that")
    file = directory / CONFIG_NAME
    if not file.is_file() and (directory / WEIGHTS_NAME).is_file():
        return _config_from_header(directory / WEIGHTS_NAME), {}
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


def _read_weights(weights: Path, device: str | None = None) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(header metadata, tensors on ``device``) of a safetensors file in one open; ``device=None``: header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), "pt", device=device or "cpu") as f:
            names = f.keys()  # safe_open is not iterable
            return f.metadata() or {}, ({} if device is None else {k: f.get_tensor(k) for k in names})
    except SafetensorError as exc:
        raise ModelError(f"{weights} is not a readable safetensors file ({exc}); a pickle (.pt) renamed to "
                         f"{WEIGHTS_NAME}? Re-save the model with save_pretrained()") from None


def _header(weights: Path) -> dict[str, str]:
    return _read_weights(weights)[0]


def _config_from_header(weights: Path) -> BackboneConfig:
    header = _header(weights)
    if "backbone" not in header:
        raise ModelError(f"no {CONFIG_NAME} beside {weights} and its header has no backbone config (written before "
                         "patchplace stored it there): restore the config.json")
    return BackboneConfig.from_dict(json.loads(header["backbone"]))


def load_pretrained(directory: str | os.PathLike, map_location: str | torch.device = "cpu"
                    ) -> tuple[Backbone, dict[str, Any]]:
    """Rebuild the backbone of a ``save_pretrained`` directory (``config.json`` or, without it, the weights'
    header); returns (model, metadata). Reads both layouts: timm-keyed and the older patchplace-keyed files."""
    config, metadata = read_config(directory)
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise ModelError(f"no {WEIGHTS_NAME} in {directory}: the checkpoint is incomplete")
    model = build_backbone(config)
    header, state = _read_weights(weights, str(map_location))
    if header.get("layout", "patchplace") != "patchplace":
        state = from_timm_state_dict(state, config)
    if (Path(directory) / EXTRAS_NAME).is_file():
        state.update(load_file(str(Path(directory) / EXTRAS_NAME), device=str(map_location)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"{weights} does not match its config.json: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    check_finite(state, weights)
    return model.to(map_location), metadata


def check_finite(state: dict[str, torch.Tensor], source: str | os.PathLike) -> None:
    """A checkpoint whose weights hold NaN / inf is refused (every output of it would be NaN, and an argmax of NaN
    still reports an accuracy): one line naming the tensors."""
    bad = [name for name, value in state.items() if value.is_floating_point() and not value.isfinite().all()]
    if bad:
        raise ModelError(f"{source} holds non-finite weights (NaN / inf in {len(bad)} tensor(s), e.g. {bad[0]}): the "
                         "training that wrote it diverged; use an earlier checkpoint, or train again with a lower "
                         "optim.lr")
