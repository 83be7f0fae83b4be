"""The authors' released weights -> a patchplace checkpoint (``config.json`` + ``model.safetensors`` + card).

    python -m patchplace.models.convert FILE --from mae|droppos|ijepa|stop|mjp|timm --out DIR

reads a released ``.pth`` / ``.pth.tar`` / ``.bin`` (or ``.safetensors``) file and writes a checkpoint that
``load_pretrained``, ``finetune.py``, ``evaluate.py``, ``python -m patchplace.export`` and the ONNX Runtime evaluator
take as they take the project's own, with the metadata their numbers depend on: normalization, input size and
crop, classes where the file has a head, the pooled feature the method's probes and fine-tuning read, the PE mode,
which encoder (I-JEPA / StoP: the target encoder, which their papers evaluate, unless ``--encoder context``).
:func:`convert_checkpoint` is the same as a function.

Safe and exact: a pickle is read with ``torch.load(weights_only=True)`` only (nothing in the file runs; the two
training-record classes the authors' files pickle, ``argparse.Namespace`` and yacs' ``CfgNode``, are read as plain
data, any other class is refused by name); ``module.`` prefixes and ``model`` / ``state_dict`` wrappers are undone;
every key of the file is either used or dropped by a rule of its layout (:mod:`patchplace.models.layouts`, which
cites the authors' model files), and an unknown or missing key, a shape that does not fit, or a file of another
layout than ``--from`` says is one line naming the key and the layout expected.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.models.convert`, before the imports below load torch: the
    # arguments parse without it (--help, a usage error), then this module runs imported by its name
    from patchplace.models.cli import convert

    sys.exit(convert())

import errno
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backbone import VisionTransformer
from .cli import parse_args
from .config import BackboneConfig
from .convert_keys import (
    check_shapes,
    check_values,
    infer_dims,
    is_weights,
    key_table,
    select_weights,
    sniff,
    split_keys,
    strip_prefix,
)
from .convert_read import (
    RECORD_CLASSES,
    TORCH_LEGACY_MAGIC,
    TrainingRecord,
    Weights,
    check_input,
    pickle_globals,
    read_file,
    read_safetensors,
    refuse_foreign_classes,
    sha256_of,
)
from .errors import ModelError
from .hub import CONFIG_NAME, save_pretrained
from .layouts import CROP_PCT_224, IMAGENET_MEAN, IMAGENET_STD, LAYOUTS, METHODS, Layout
from .timm_interop import from_timm_state_dict, pos_embed_mode_of

# the reading (convert_read) and the layout checks (convert_keys) live beside this module; their names stay
# importable from here
__all__ = [
    "RECORD_CLASSES", "TORCH_LEGACY_MAGIC", "Conversion", "TrainingRecord", "Weights", "backbone_config", "build",
    "check_input", "check_shapes", "check_values", "checkpoint_metadata", "convert_checkpoint", "describe",
    "infer_dims", "is_weights", "key_table", "main", "name_problem", "pickle_globals", "read_file",
    "read_safetensors", "refuse_foreign_classes", "run_files", "select_weights", "sha256_of", "sniff", "split_keys",
    "strip_prefix", "timm_state", "training_run_of",
]


@dataclass
class Conversion:
    """What :func:`convert_checkpoint` did: the file's keys used (patchplace's names follow from timm's) and
    dropped (by rule), the backbone config and the output directory."""

    layout: str
    entry: str
    used: list[str]
    dropped: dict[str, list[str]]
    config: BackboneConfig
    out: Path
    pos_embed: str
    metadata: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- the backbone
def backbone_config(kept: Weights, layout: Layout, dims: dict[str, int]) -> tuple[BackboneConfig, str]:
    """The backbone config of the encoder and how its PE was read (sincos2d: the fixed table, recomputed)."""
    grid = math.isqrt(dims["N"])
    has_pe = layout.pos_key in kept
    pe, how = "none", "none: the file has no position embedding"
    if has_pe:
        table = _pe_table(kept, layout, dims)
        pe, diff = pos_embed_mode_of(table, (grid, grid), dims["T"])
        how = ("sincos2d: the file's table is the fixed 2-D sin-cos one (max difference "
               f"{diff:.1e}), recomputed" if pe == "sincos2d" else "learned: the file's table, as it is")
    fc_norm = "fc_norm.weight" in kept
    class_token = dims["T"] == 1
    config = BackboneConfig(
        modality="image", img_size=grid * dims["P"], patch_size=dims["P"], in_chans=dims["C"], embed_dim=dims["D"],
        depth=dims["depth"], num_heads=dims["heads"], mlp_ratio=dims["H"] / dims["D"],
        qkv_bias="blocks.0.attn.qkv.bias" in kept, pos_embed=pe, unknown_pos=layout.unknown_row,
        class_token=class_token, global_pool="cls" if class_token and not fc_norm else "mean", fc_norm=fc_norm,
        num_classes=dims["K"], norm_eps=1e-6)  # every layout's LayerNorm: partial(nn.LayerNorm, eps=1e-6)
    return config.validate(), how


def _pe_table(kept: Weights, layout: Layout, dims: dict[str, int]) -> torch.Tensor:
    """The additive table (prefix + N, D), without MJP's unknown row."""
    table = kept[layout.pos_key].reshape(-1, dims["D"])
    return table[: dims["T"] + dims["N"]]


def timm_state(kept: Weights, layout: Layout, dims: dict[str, int]) -> tuple[Weights, Weights]:
    """(the encoder under timm's keys, patchplace-only parameters): MJP's nn.Embedding splits into timm's
    ``pos_embed`` (class token + patches) and the unknown PE (its last row)."""
    state = {k: v for k, v in kept.items() if k != layout.pos_key}
    extras = {}
    if layout.pos_key in kept:
        state["pos_embed"] = _pe_table(kept, layout, dims).unsqueeze(0)
    if layout.unknown_row:
        extras["unknown_pos_embed"] = kept[layout.pos_key].reshape(-1, dims["D"])[-1].reshape(1, 1, -1)
    return state, extras


def build(config: BackboneConfig, state: Weights, extras: Weights) -> VisionTransformer:
    """The backbone with the converted weights, loaded strictly (float32, eval mode)."""
    model = VisionTransformer(config)
    ours = {k: v.float() for k, v in {**from_timm_state_dict(state, config), **extras}.items()}
    missing, unexpected = model.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ModelError(f"the converted weights do not fit the backbone: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]} (a converter bug: please report it with the file's layout)")
    return model.eval()


# ------------------------------------------------------------------------------------------------ metadata
def checkpoint_metadata(layout: Layout, config: BackboneConfig, *, method: str | None, mean: tuple[float, ...],
                        std: tuple[float, ...], crop_pct: float | None, dataset: str,
                        classes: list[str] | None) -> dict[str, Any]:
    """What evaluation reads from the checkpoint: method (a classifier's as ``finetune:<method>``), paper, the
    pooled features its probes and fine-tuning read, normalization, input side and crop, classes, license."""
    name = layout.method or method or "supervised"
    facts = METHODS[name]
    side = config.image_hw[0]
    if len(mean) != config.in_chans or len(std) != config.in_chans or min(std) <= 0:
        raise ModelError(f"--mean {list(mean)} / --std {list(std)}: the model takes {config.in_chans}-channel images "
                         f"(give {config.in_chans} values each, std > 0)")
    if crop_pct is not None and not 0 < crop_pct <= 1:
        raise ModelError(f"--crop-pct {crop_pct}: must lie in (0, 1] (resize to size / crop_pct, then centre crop)")
    meta: dict[str, Any] = {
        "normalization": {"mean": list(mean), "std": list(std), "computed_on": f"{dataset} (the authors' recipe)"},
        "modality": "image", "img_size": side, "pad_to": None,
        "crop_pct": crop_pct if crop_pct is not None else (CROP_PCT_224 if side == 224 else 1.0),
        "data": {"dataset": dataset}, "license": layout.license}
    if config.num_classes and not facts.trains_head:  # a fine-tuned release: its head reads the backbone's pooling
        pool = "mean_fc_norm" if config.fc_norm else config.global_pool
        meta.update(method=f"finetune:{name}", pretrain_metadata={"method": name, "paper": facts.paper},
                    probe_feature=config.global_pool, finetune_pool=pool)
    else:
        probe = facts.probe_feature if config.class_token or facts.probe_feature == "patch_mean" else "mean"
        pool = facts.finetune_pool if config.class_token or facts.finetune_pool != "cls" else "mean"
        meta.update(method=name, paper=facts.paper, probe_feature=probe, finetune_pool=pool)
    if classes is None and config.num_classes == 1000:
        from timm.data import ImageNetInfo  # the ImageNet-1k synsets in class-index order (an ImageFolder's order)

        classes = list(ImageNetInfo("imagenet-1k").label_names())
    if classes is not None:
        if len(classes) != config.num_classes:
            raise ModelError(f"{len(classes)} class names given for a head of {config.num_classes} classes")
        meta["classes"] = list(classes)
    return meta


# ------------------------------------------------------------------------------------------------ the converter
def convert_checkpoint(file: str | Path, layout: str, out: str | Path, *, encoder: str | None = None,
                       num_heads: int | None = None, method: str | None = None,
                       mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
                       crop_pct: float | None = None, dataset: str = "imagenet-1k",
                       classes: list[str] | None = None) -> Conversion:
    """Convert an authors' released ``file`` of ``layout`` (:data:`~patchplace.models.layouts.LAYOUTS`) into the
    checkpoint directory ``out``; returns what was used and dropped. ``encoder``: I-JEPA / StoP ``target``
    (default, what their papers evaluate) or ``context``; ``num_heads`` for a width outside the standard ViTs;
    ``method`` names a timm-layout file's training (``supervised`` by default); ``mean`` / ``std`` / ``crop_pct``
    / ``dataset`` / ``classes`` override the authors' ImageNet evaluation recipe."""
    file, out = Path(file), Path(out)
    spec = _layout(layout)
    _check_options(spec, encoder, method, out)
    obj = read_file(file)
    weights, entry, entries_dropped = select_weights(obj, spec, encoder, file)
    kept, dropped = split_keys(weights, spec, file)
    table = key_table(kept, spec, file)
    check_values(kept, spec, file)
    dims = infer_dims(kept, spec, file, num_heads)
    check_shapes(kept, table, spec, dims, file)
    config, how = backbone_config(kept, spec, dims)
    state, extras = timm_state(kept, spec, dims)
    model = build(config, state, extras)
    for name, rule in entries_dropped.items():
        dropped.setdefault(rule, []).append(f"[{name}]")
    meta = checkpoint_metadata(spec, config, method=method, mean=tuple(mean), std=tuple(std), crop_pct=crop_pct,
                               dataset=dataset, classes=classes)
    epoch = obj.get("epoch") if isinstance(obj, dict) and isinstance(obj.get("epoch"), int) else None
    meta["converted_from"] = {"file": file.name, "sha256": sha256_of(file), "layout": spec.name,
                              "source": spec.source, "entry": entry or "(top level)", "epoch": epoch,
                              "pos_embed": how, "keys_used": len(kept), "dropped": dropped}
    save_pretrained(model, out, meta)
    return Conversion(spec.name, entry, sorted(kept), dropped, config, out, how, meta)


def _layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ModelError(f"--from {name!r}: the layouts are {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def _check_options(spec: Layout, encoder: str | None, method: str | None, out: Path) -> None:
    """What the options cannot mean, refused before the file is read; ``out`` must be new or a checkpoint (it is
    replaced whole)."""
    if encoder is not None and not spec.encoders:
        raise ModelError(f"--encoder {encoder}: {spec.display} files hold one encoder (--encoder is for ijepa / stop)")
    if method is not None and (spec.method is not None or method not in METHODS):
        raise ModelError(f"--method {method}: " + (f"a {spec.display} file's method is {spec.method}" if spec.method
                                                   else f"one of {', '.join(METHODS)}"))
    if problem := name_problem(out):
        raise ModelError(problem)
    if run := training_run_of(out):
        raise ModelError(f"--out {out} lies inside the training run {run} (its {', '.join(run_files(run))}): a "
                         "conversion there would replace or repoint the run's checkpoints; choose a directory "
                         "outside any run")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / CONFIG_NAME).is_file())):
        raise ModelError(f"--out {out} exists and is not a checkpoint directory (it would be replaced whole): choose "
                         "a new directory")


def name_problem(out: Path) -> str | None:
    """The one line for an ``--out`` this file system cannot hold (a part over its NAME_MAX, the whole over its
    PATH_MAX; read from the deepest existing folder), or None: the writes would otherwise fail mid-way."""
    absolute = os.path.abspath(out)
    folder = absolute
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError):  # no limits to read
        return None
    # save_pretrained writes .NAME.partial-XXXXXXXX beside it: that name must fit too
    longest = max(Path(absolute).parts, key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) + len(".partial-") + 9 > name_max:
        return (f"--out: the name {longest[:24]}... is {len(os.fsencode(longest))} bytes long, and this file system "
                f"takes names of at most {name_max} (the checkpoint is written as .NAME.partial-* first): choose a "
                "shorter --out")
    if len(os.fsencode(absolute)) + 64 >= path_max:
        return f"--out: its path is {len(os.fsencode(absolute))} bytes long, near this system's {path_max}: choose a " \
               "shorter --out"
    return None


def run_files(directory: Path) -> list[str]:
    """The files that make ``directory`` a training run of patchplace.pipelines (its ``config.yaml`` or
    ``log.jsonl`` beside its ``.lock``, ``checkpoints/`` or ``checkpoint`` link) or a sealed checkpoint step of one
    (``COMPLETE`` beside ``checkpoint/``); [] for any other directory (a lone ``.lock``, as pytest's, is none)."""
    if (directory / "COMPLETE").is_file() and (directory / "checkpoint").is_dir():
        return ["COMPLETE", "checkpoint/"]
    records = [name for name in ("config.yaml", "log.jsonl") if (directory / name).is_file()]
    state = [name for name, there in ((".lock", (directory / ".lock").is_file()),
                                      ("checkpoints/", (directory / "checkpoints").is_dir()),
                                      ("checkpoint link", (directory / "checkpoint").is_symlink())) if there]
    return records + state if records and state else []


def training_run_of(out: Path) -> Path | None:
    """The training run directory ``out`` lies in (or is), spelled as given or through its symlinks
    (``RUN/checkpoint`` links into ``RUN/checkpoints/step-N``), else None."""
    runs = [directory for spelling in dict.fromkeys((Path(os.path.abspath(out)), out.resolve()))
            for directory in (spelling, *spelling.parents) if directory.is_dir() and run_files(directory)]
    return max(runs, key=lambda d: (len(run_files(d)), -len(d.parts)), default=None)  # the run, not its step


def describe(conv: Conversion) -> str:
    """The conversion in a few lines (what the command prints)."""
    c = conv.config
    lines = [f"{conv.layout}: {conv.entry or '(top level)'} -> {conv.out}",
             f"  backbone: {c.embed_dim} wide, {c.depth} blocks, {c.num_heads} heads, patch {c.patch_size}, "
             f"{c.image_hw[0]} px, PE {conv.pos_embed}, class token {'yes' if c.class_token else 'no'}, pool "
             f"{c.global_pool}{' + fc_norm' if c.fc_norm else ''}, {c.num_classes or 'no'} classes"
             + (", MJP unknown PE" if c.unknown_pos else ""),
             f"  used: {len(conv.used)} keys",
             *[f"  dropped ({rule}): " + (", ".join(k.strip("[]") for k in keys) if keys[0].startswith("[")
                                           else f"{len(keys)} key{'s' if len(keys) > 1 else ''}")
               for rule, keys in conv.dropped.items()],
             f"  method {conv.metadata['method']}, probes read {conv.metadata['probe_feature']}, fine-tuning "
             f"pools {conv.metadata['finetune_pool']}, license {conv.metadata['license']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        conv = convert_checkpoint(args.file, args.layout, args.out, encoder=args.encoder, num_heads=args.num_heads,
                                  method=args.method, mean=tuple(args.mean), std=tuple(args.std),
                                  crop_pct=args.crop_pct, dataset=args.dataset)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # what the checks before the write could not foresee (a disk full, a lost mount)
        print(f"error: --out {args.out}: {exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, 'OSError')}"
              f"{f' on {exc.filename}' if exc.filename else ''}): nothing was converted; free the place or choose "
              "another --out", file=sys.stderr)
        return 2
    print(describe(conv))
    return 0
