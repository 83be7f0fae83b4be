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

``pretrained_cfg`` makes timm's eval transform (``timm.data.create_transform(**timm.data.resolve_data_config({},
model=model))``) give exactly the tensor patchplace evaluated on where timm can express it — zero padding (e.g.
Fashion-MNIST 28 -> 32 px) is encoded as ``crop_pct = input / native`` (:func:`~patchplace.models.timm_interop.
timm_preprocessing`) — and says in ``notes`` where it cannot; :func:`timm_transform` is that transform in any case.

This module knows checkpoint files, not model classes: it works on a model's ``config`` / ``state_dict`` and
returns state dicts (:func:`load_state`); :func:`~patchplace.models.backbone.load_pretrained` builds the backbone.
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
from torch import nn

from .card import card_license, model_card
from .config import BackboneConfig
from .errors import ModelError
from .timm_interop import (
    TIMM_ARCHITECTURES,
    describe_preprocessing,
    eval_preprocessing,
    from_timm_state_dict,
    split_extras,
    timm_layout,
    timm_model_args,
    timm_preprocessing,
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


def save_pretrained(model: nn.Module, directory: str | os.PathLike, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``directory/{config.json, model.safetensors, README.md}`` (+ ``extras.safetensors``) of a patchplace
    backbone through a temp dir + rename. Absolute paths in ``metadata`` are reduced to their last component (a
    checkpoint is shared)."""
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
        num_params = sum(p.numel() for p in model.parameters())
        (tmp / CARD_NAME).write_text(model_card(model.config, metadata, layout, num_params))
        for file in tmp.iterdir():
            os.chmod(file, 0o666 & ~_umask())  # safetensors creates its files 0600
        # the swap of patchplace.data.atomic.swap_dir: models may not import data (both depend on nothing of ours)
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
    data, gap = timm_preprocessing(config, metadata)
    note = (f"patchplace eval preprocessing: {describe_preprocessing(config, metadata)}; "
            + ("timm.data.create_transform(**timm.data.resolve_data_config({}, model=model)) reproduces it exactly"
               + (" (crop_pct > 1: timm's resize keeps the image, torchvision's center crop zero-pads it)"
                  if data["crop_pct"] > 1 else "") if gap is None else
               f"timm's eval transform does NOT reproduce it ({gap}): use "
               "patchplace.models.timm_transform(<this directory>)"))
    fields.update(architecture=TIMM_ARCHITECTURES[layout], model_args=timm_model_args(config), pretrained_cfg={
        **data, "fixed_input_size": True, "num_classes": config.num_classes, "first_conv": "patch_embed.proj",
        "classifier": "head", "license": card_license(metadata), "notes": [note]})
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
    """Add ``fields`` (e.g. the metrics measured after the checkpoint was written, or ``base_model`` once the
    pretraining checkpoint is on the Hub) to a checkpoint's metadata and rewrite its model card and timm fields; each
    file is replaced atomically, the weights are not rewritten."""
    directory = Path(directory)
    config, state, metadata = load_state(directory)  # the card counts the parameters
    metadata = _without_local_paths({**metadata, **fields})
    raw = json.loads((directory / CONFIG_NAME).read_text())
    raw["metadata"] = metadata
    layout = timm_layout(config)
    raw.update(hub_fields(config, metadata, layout))
    num_params = sum(v.numel() for v in state.values())
    card = model_card(config, metadata, layout, num_params)  # before any file: a bad license changes none
    for name, text in ((CONFIG_NAME, json.dumps(raw, indent=2) + "\n"), (CARD_NAME, card)):
        part = directory / f".{name}.partial"
        part.write_text(text)
        os.replace(part, directory / name)


def read_config(directory: str | os.PathLike) -> tuple[BackboneConfig, dict[str, Any]]:
    """The backbone config and metadata of a checkpoint directory."""
    directory = Path(directory)
    if directory.suffix in PICKLE_SUFFIXES or (directory.is_dir() and not (directory / CONFIG_NAME).exists()
                                               and any(p.suffix in PICKLE_SUFFIXES for p in directory.iterdir())):
        raise ModelError(f"refusing to load {directory}: pickle checkpoints (.pt/.pth) can run code when loaded; "
                         "an authors' released file converts safely with python -m patchplace.models.convert FILE "
                         "--from mae|droppos|ijepa|stop|mjp|timm --out DIR, a model of yours saves with "
                         "save_pretrained() (config.json + model.safetensors): load that")
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


def load_state(directory: str | os.PathLike, map_location: str | torch.device = "cpu"
               ) -> tuple[BackboneConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(backbone config, state dict under patchplace's names with the extras, metadata) of a ``save_pretrained``
    directory; reads both layouts (timm-keyed and the older patchplace-keyed files). Every entry is a parameter
    (the backbones' buffers are not persistent). :func:`~patchplace.models.backbone.load_pretrained` builds the
    model from it."""
    config, metadata = read_config(directory)
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise ModelError(f"no {WEIGHTS_NAME} in {directory}: the checkpoint is incomplete")
    header, state = _read_weights(weights, str(map_location))
    if header.get("layout", "patchplace") != "patchplace":
        state = from_timm_state_dict(state, config)
    if (Path(directory) / EXTRAS_NAME).is_file():
        state.update(load_file(str(Path(directory) / EXTRAS_NAME), device=str(map_location)))
    return config, state, metadata


def check_finite(state: dict[str, torch.Tensor], source: str | os.PathLike) -> None:
    """A checkpoint whose weights hold NaN / inf is refused (every output of it would be NaN, and an argmax of NaN
    still reports an accuracy): one line naming the tensors."""
    bad = [name for name, value in state.items() if value.is_floating_point() and not value.isfinite().all()]
    if bad:
        raise ModelError(f"{source} holds non-finite weights (NaN / inf in {len(bad)} tensor(s), e.g. {bad[0]}): the "
                         "training that wrote it diverged; use an earlier checkpoint, or train again with a lower "
                         "optim.lr")


def timm_data_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The data config with which ``timm.data.create_transform(**config)`` gives exactly the tensor the checkpoint
    was evaluated on (what ``resolve_data_config({}, model=model)`` returns for the ``local-dir:`` model). Raises
    :class:`ModelError` where timm's transform cannot (e.g. zero padding followed by a resize): use
    :func:`timm_transform` there."""
    config, metadata = read_config(directory)
    data, gap = timm_preprocessing(config, metadata)
    if gap is not None:
        raise ModelError(f"timm's eval transform cannot reproduce the preprocessing of {directory} "
                         f"({describe_preprocessing(config, metadata)}): {gap}; use "
                         "patchplace.models.timm_transform(directory), which does")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def timm_transform(directory: str | os.PathLike) -> EvalTransform:
    """The eval transform of an image checkpoint: PIL image (or uint8 ``(C, H, W)`` tensor) -> the float tensor
    the checkpoint was evaluated on, exactly as ``patchplace.data`` made it (zero-pad to ``pad_to``, resize + center
    crop to the model's input, /255, normalize). Works whether or not timm's own transform can reproduce it."""
    config, metadata = read_config(directory)
    prep = eval_preprocessing(config, metadata)
    if not prep["normalized"]:
        raise ModelError(f"{directory} records no normalization statistics (metadata.normalization): the inputs it "
                         "was trained on cannot be reproduced; pass mean / std to timm.data.create_transform yourself")
    return EvalTransform(prep, describe_preprocessing(config, metadata))


class EvalTransform:
    """``patchplace.data``'s eval image transform rebuilt from a checkpoint's metadata (:func:`timm_transform`):
    zero padding (centered) in uint8, then timm's eval transform with the recorded ``crop_pct`` (1 unless an
    unpadded checkpoint records one; bicubic), as the reader does.
    Images of another size than the training data's are refused, as the reader refuses them."""

    def __init__(self, prep: dict[str, Any], description: str) -> None:
        from timm.data import create_transform

        self.channels, self.native, self.pad_to = prep["channels"], prep["native"], prep["pad_to"]
        self.description = description
        h, w = prep["size"]
        self.timm = create_transform(input_size=(self.channels, h, w), is_training=False, interpolation="bicubic",
                                     crop_pct=prep["crop_pct"], mean=tuple(prep["mean"]), std=tuple(prep["std"]))

    def __repr__(self) -> str:
        return f"EvalTransform({self.description})"

    def __call__(self, image: Any) -> torch.Tensor:
        from torchvision.transforms.functional import pil_to_tensor, to_pil_image

        if not isinstance(image, torch.Tensor):  # a PIL image
            mode = "L" if self.channels == 1 else "RGB"
            image = pil_to_tensor(image if image.mode == mode else image.convert(mode))
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != self.channels:
            raise ModelError(f"expected a PIL image or a uint8 ({self.channels}, H, W) tensor, got {image.dtype} "
                             f"{tuple(image.shape)}")
        h, w = image.shape[-2:]
        if self.native is not None and (h, w) != self.native:
            raise ModelError(f"a {h}x{w} image, but this checkpoint was trained on {self.native[0]}x{self.native[1]} "
                             "images: resize it to that size first")
        if self.pad_to is not None:
            if h > self.pad_to or w > self.pad_to:
                raise ModelError(f"cannot pad a {h}x{w} image to {self.pad_to}: it is larger")
            top, left = (self.pad_to - h) // 2, (self.pad_to - w) // 2
            image = torch.nn.functional.pad(image, (left, self.pad_to - w - left, top, self.pad_to - h - top))
        return self.timm(to_pil_image(image))
