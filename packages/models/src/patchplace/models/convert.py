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
import hashlib
import io
import math
import os
import re
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backbone import VisionTransformer
from .cli import parse_args
from .config import BackboneConfig
from .errors import ModelError
from .hub import CONFIG_NAME, FORMAT, save_pretrained
from .layouts import (
    CROP_PCT_224,
    HEADS_BY_WIDTH,
    IMAGENET_MEAN,
    IMAGENET_STD,
    LAYOUTS,
    METHODS,
    TRAINING_STATE,
    Layout,
    Shape,
)
from .timm_interop import from_timm_state_dict, pos_embed_mode_of

Weights = dict[str, torch.Tensor]


class TrainingRecord:
    """What an ``argparse.Namespace`` in an authors' file is read as: its attributes as plain data (no code of the
    file's class runs; see :func:`read_file`)."""


# Classes the authors' training checkpoints pickle beside the weights (MAE / DeiT: the argparse Namespace 'args';
# MJP, a Swin-Transformer code base: the yacs CfgNode 'config'), mapped to inert stand-ins. CfgNode is a dict
# subclass: an OrderedDict takes its items and attributes exactly as the weights-only unpickler fills a dict.
RECORD_CLASSES = {"argparse.Namespace": TrainingRecord, "yacs.config.CfgNode": OrderedDict}


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


# ----------------------------------------------------------------------------------------------------- reading
def read_file(path: str | Path) -> Any:
    """The object in a released file, loaded without running any of its code: safetensors as they are (a
    patchplace checkpoint's own ``model.safetensors`` is refused: it needs no conversion); pickles with
    ``torch.load(weights_only=True, mmap=True)`` after listing the classes they name (one not in
    :data:`RECORD_CLASSES` is refused by name before anything is unpickled; so is a plain pickle, which is not
    ``torch.save``'s format)."""
    path = Path(path)
    check_input(path)
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    refuse_foreign_classes(path)
    with warnings.catch_warnings():  # torch's "detected pickle protocol" warning: the refusal below says it all
        warnings.simplefilter("ignore")
        with torch.serialization.safe_globals([(cls, name) for name, cls in RECORD_CLASSES.items()]):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
            except Exception as exc:  # pickle, zip and torch errors alike: the file is refused
                raise ModelError(f"{path} cannot be read as a PyTorch checkpoint with weights_only=True "
                                 f"({_first_line(exc)}): damaged, or not a torch.save file; download it again"
                                 ) from None


def check_input(path: Path) -> None:
    """Refuse, in one line with the fix, a FILE that is not a file to read: missing, a directory (a patchplace
    checkpoint directory needs no conversion), or empty (an interrupted download)."""
    if path.is_dir():
        if (path / CONFIG_NAME).is_file():
            raise ModelError(f"{path} is a patchplace checkpoint directory, which needs no conversion: pass it as it "
                             f"is (load_pretrained, model.checkpoint={path}, python -m patchplace.export {path})")
        raise ModelError(f"{path} is a directory, not a released weights file: give the .pth / .pth.tar / .bin / "
                         ".safetensors file itself")
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise ModelError(f"{path} is empty (0 bytes): an interrupted download or copy; download the file again")


def read_safetensors(path: Path) -> Weights:
    """A ``.safetensors`` file's tensors; a patchplace checkpoint's own weights (its header names the format) are
    refused: converted, they would be relabelled an authors' release (method, license, probe feature)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
        weights = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise ModelError(f"{path} is not a readable safetensors file ({_first_line(exc)}): damaged; download it "
                         "again") from None
    if header.get("format") == FORMAT:
        raise ModelError(f"{path} is the weights file of a patchplace checkpoint (its header says {FORMAT}), not an "
                         f"authors' release: use its directory {path.parent} as it is (load_pretrained, "
                         f"model.checkpoint={path.parent}); converting it would relabel it")
    return weights


def refuse_foreign_classes(path: Path) -> None:
    """Refuse, naming them, the classes and functions a pickle would create or call beyond tensors and containers
    (e.g. ``posix.system``), read by disassembly (:func:`pickle_globals`): the file is not unpickled at all. Also
    refused: a plain pickle (``pickle.dump``, not ``torch.save``), and a pickle protocol above 3, which
    ``torch.load(weights_only=True)`` cannot read (its FRAME opcode)."""
    from torch._weights_only_unpickler import _get_allowed_globals  # torch's own allowlist of weights_only

    found, protocol = pickle_globals(path)
    foreign = sorted(found - set(_get_allowed_globals()) - set(RECORD_CLASSES))
    if foreign:
        raise ModelError(f"refusing {path}: its pickle names {', '.join(foreign)}, which loading would create or call "
                         "(only tensors, containers, argparse.Namespace and yacs CfgNode records are read); this is "
                         "not a released weights file, or one re-saved with other objects in it")
    if protocol > 3:
        raise ModelError(f"{path} was pickled with protocol {protocol}, which torch.load(weights_only=True) cannot "
                         "read (and nothing here unpickles a file otherwise): re-save it where it was made with "
                         "torch.save(obj, FILE) at torch's default protocol, or with safetensors.torch.save_file")


TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of torch.save(_use_new_zipfile_serialization=False)


def pickle_globals(path: Path) -> tuple[set[str], int]:
    """(the ``module.name`` globals a checkpoint's pickles name, their pickle protocol), read by
    :mod:`pickletools` (nothing runs): a zip checkpoint's ``data.pkl``; torch's legacy format, four pickles
    (magic number, protocol, system info, the object). A file whose first pickle is not torch's magic number is a
    plain pickle, refused: ``torch.load`` reads none without unpickling it."""
    if _is_zip(path):
        try:
            with zipfile.ZipFile(path) as archive:
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                data = archive.read(name)
        except Exception as exc:  # a damaged archive, or one without data.pkl
            raise ModelError(f"{path} is not a readable PyTorch checkpoint ({_first_line(exc)}): damaged; download "
                             "it again") from None
        _, found, protocol = _pickle_globals(io.BytesIO(data), path)
        return found, protocol
    with open(path, "rb") as f:
        first, found, protocol = _pickle_globals(f, path)
        if first != TORCH_LEGACY_MAGIC:
            raise ModelError(f"refusing {path}: a plain pickle (pickle.dump, not torch.save's format)"
                             + (f" naming {', '.join(sorted(found))}" if found else "")
                             + ", which only running its code could read; re-save the weights where they were made "
                             "with torch.save(state_dict, FILE) or safetensors.torch.save_file")
        for _ in range(3):  # protocol version, system info, the object
            _, more, protocol = _pickle_globals(f, path)
            found |= more
    return found, protocol


def _pickle_globals(f: Any, path: Path) -> tuple[Any, set[str], int]:
    """(the last integer constant of one pickle read from ``f`` up to its STOP, the globals it names, its protocol)
    by :func:`pickletools.genops`, which disassembles and runs nothing."""
    import pickletools

    found: set[str] = set()
    strings: list[str] = []  # STACK_GLOBAL takes module and name from the two strings pushed before it
    memo: dict[int, Any] = {}
    last: Any = None  # the value the last op pushed (what MEMOIZE / PUT store)
    constant, protocol = None, 2
    try:
        for op, arg, _ in pickletools.genops(f):
            if op.name == "PROTO":
                protocol = arg
            elif op.name == "GLOBAL":
                found.add(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.add(f"{strings[-2]}.{strings[-1]}")
            elif op.name == "MEMOIZE":
                memo[len(memo)] = last
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = last
            elif op.name in ("GET", "BINGET", "LONG_BINGET") and isinstance(memo.get(arg), str):
                strings.append(memo[arg])
            if op.name not in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                last = arg
            if isinstance(arg, str) and ("UNICODE" in op.name or "STRING" in op.name):
                strings.append(arg)
            elif isinstance(arg, int) and op.name in ("LONG1", "LONG4", "LONG", "INT", "BININT", "BININT1",
                                                      "BININT2"):
                constant = arg
    except Exception as exc:  # not a pickle at all (or cut short)
        raise ModelError(f"{path} is not a PyTorch checkpoint (neither torch.save's zip archive nor a pickle: "
                         f"{_first_line(exc)}): damaged, or another format; download it again") from None
    return constant, found, protocol


def _is_zip(path: Path) -> bool:
    return zipfile.is_zipfile(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    detail = [line for line in text if "GLOBAL" in line or "Unsupported" in line]
    return (detail or text or [type(exc).__name__])[0][:300]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


# ------------------------------------------------------------------------------------------ finding the weights
def is_weights(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def strip_prefix(weights: Weights) -> Weights:
    """Undo DDP's ``module.`` (and ``model.`` of wrapped models) when every key has it."""
    for prefix in ("module.", "model."):
        if weights and all(k.startswith(prefix) for k in weights):
            weights = {k[len(prefix):]: v for k, v in weights.items()}
    return weights


def select_weights(obj: Any, layout: Layout, encoder: str | None, file: Path) -> tuple[Weights, str, dict]:
    """(the encoder's weights, the entry they sat in, {dropped top-level entry: rule})."""
    if not isinstance(obj, dict):
        raise ModelError(f"{file} holds a {type(obj).__name__}, not a state dict or a checkpoint dict "
                         f"({layout.display} layout: {layout.source})")
    if layout.encoders:
        choice = encoder or "target"
        if choice not in layout.encoders:
            raise ModelError(f"--encoder {choice}: {layout.display} files hold {sorted(layout.encoders)}")
        entry = layout.encoders[choice]
        if not is_weights(obj.get(entry)):
            held = [k for k in layout.encoders.values() if is_weights(obj.get(k))]
            other = f"; it holds {held}: pass --encoder {_choice_of(layout, held[0])}" if held else ""
            raise ModelError(f"{file} has no '{entry}' entry ({choice} encoder) as {layout.display} files do "
                             f"(top-level entries: {_names(obj)}){other}{_hint(obj, layout)}")
    elif is_weights(obj):
        entry = ""
    else:
        entry = next((e for e in layout.entries if e and is_weights(obj.get(e))), None)
        if entry is None:
            raise ModelError(f"{file} holds no weights under {' / '.join(repr(e) for e in layout.entries if e)} (top-"
                             f"level entries: {_names(obj)}); the {layout.display} layout: {layout.source}"
                             + _hint(obj, layout))
    weights = strip_prefix(dict(obj if entry == "" else obj[entry]))
    return weights, entry, {} if entry == "" else _other_entries(obj, entry, layout, file)


def _choice_of(layout: Layout, entry: str) -> str:
    return next(k for k, v in layout.encoders.items() if v == entry)


def _names(obj: dict) -> str:
    names = [str(k) for k in obj][:12]
    return ", ".join(names) + (", ..." if len(obj) > 12 else "")


def _other_entries(obj: dict, entry: str, layout: Layout, file: Path) -> dict[str, str]:
    """The rule each other top-level entry is dropped by; an unknown entry holding weights is refused."""
    out = {}
    for name, value in obj.items():
        if name == entry:
            continue
        if name in layout.encoders.values():
            out[name] = f"the {_choice_of(layout, name)} encoder (--encoder {_choice_of(layout, name)} converts it)"
        elif name in layout.other_entries:
            out[name] = layout.other_entries[name]
        elif name in TRAINING_STATE:
            out[name] = TRAINING_STATE[name]
        elif is_weights(value):
            raise ModelError(f"{file} holds weights under '{name}', which the {layout.display} layout does not know "
                             f"(its weights sit in '{entry}'; {layout.source})")
        else:
            out[name] = "training record (no weights)"
    return out


def sniff(obj: Any) -> str | None:
    """The layout a file looks like, from the keys only the authors' own code writes (None: undecided)."""
    if not isinstance(obj, dict):
        return None
    if any(is_weights(obj.get(k)) for k in ("target_encoder", "encoder")):
        return "ijepa or stop"
    weights = obj if is_weights(obj) else next((obj[k] for k in ("state_dict", "model") if is_weights(obj.get(k))), {})
    keys = set(strip_prefix(dict(weights)))
    if "pos_embed.weight" in keys:
        return "mjp"
    if keys & {"mask_pos_token", "aux_decoder_embed.weight"}:
        return "droppos"
    if keys & {"decoder_pos_embed", "decoder_pred.weight"}:
        return "mae"
    return None


def _hint(obj: Any, layout: Layout) -> str:
    guess = sniff(obj)
    if guess is None or layout.name in guess.split(" or "):
        return ""
    return f"; the file looks like a {guess} checkpoint: --from {guess.split(' or ')[0]}"


# ---------------------------------------------------------------------------------------- keys, shapes, dims
def split_keys(weights: Weights, layout: Layout, file: Path) -> tuple[Weights, dict[str, list[str]]]:
    """(the encoder's keys, {rule: keys dropped by it}); a key neither is refused, naming what it is."""
    kept, dropped = {}, {}
    for key, value in weights.items():
        rule = next((r for pattern, r in layout.dropped if re.match(pattern, key)), None)
        if rule is not None:
            dropped.setdefault(rule, []).append(key)
            continue
        feature = next((what for pattern, what in layout.refused if re.search(pattern, key)), None)
        if feature is not None:
            raise ModelError(f"{file}: '{key}' is {feature}, which patchplace backbones do not have "
                             f"({layout.display} layout)")
        kept[key] = value
    return kept, dropped


def check_values(kept: Weights, layout: Layout, file: Path) -> None:
    """Every encoder tensor floating-point and finite: an integer tensor would be cast (``.float()``) into a
    weight it never was, a NaN / inf one gives NaN everywhere downstream."""
    for key, value in kept.items():
        if not value.is_floating_point():
            raise ModelError(f"{file}: '{key}' is {str(value.dtype).removeprefix('torch.')}, not a floating-point "
                             f"weight as every {layout.display} encoder tensor is: the file is damaged or not a "
                             "weights file; download it again")
    for key, value in kept.items():
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            kinds = " and ".join(k for k, hit in (("NaN", torch.isnan(value).any()), ("inf", torch.isinf(value).any()))
                                 if bool(hit))
            raise ModelError(f"{file}: '{key}' holds {kinds} ({bad} of {value.numel()} values): the training that "
                             "wrote it diverged or the file is damaged; download it again, or convert another "
                             "epoch's file")


def infer_dims(kept: Weights, layout: Layout, file: Path, num_heads: int | None) -> dict[str, int]:
    """The widths the encoder's tensors imply (D, H, C, P, N, K, T, depth, heads)."""
    proj = kept.get("patch_embed.proj.weight")
    if proj is None or proj.dim() != 4 or proj.shape[2] != proj.shape[3]:
        raise ModelError(f"{file}: {'no' if proj is None else 'a non-square'} 'patch_embed.proj.weight' (a "
                         f"{layout.display} encoder's patch embedding, (D, C, P, P)); the layout: {layout.source}")
    d, c, p = (int(s) for s in proj.shape[:3])
    depth = _depth(kept)
    fc1 = kept.get("blocks.0.mlp.fc1.weight")
    with_cls = "cls_token" in kept or ("cls_token" in layout.keys and "cls_token" not in layout.optional)
    dims = {"D": d, "C": c, "P": p, "depth": depth, "H": int(fc1.shape[0]) if fc1 is not None else 4 * d,
            "T": int(with_cls), "K": int(kept["head.weight"].shape[0]) if "head.weight" in kept else 0}
    dims["N"] = _num_patches(kept, layout, dims, file)
    heads = num_heads or HEADS_BY_WIDTH.get(d)
    if heads is None or d % heads:
        raise ModelError(f"{file}: embed_dim {d} is not a standard ViT width ({sorted(HEADS_BY_WIDTH)}): pass "
                         "--num-heads (the authors' model file names it)" if heads is None else
                         f"{file}: embed_dim {d} is not divisible by --num-heads {heads}")
    dims["heads"] = heads
    return dims


def _depth(kept: Weights) -> int:
    return 1 + max((int(m.group(1)) for k in kept if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)


def _num_patches(kept: Weights, layout: Layout, dims: dict[str, int], file: Path) -> int:
    table = kept.get(layout.pos_key) if layout.pos_key else None
    if table is None:
        raise ModelError(f"{file}: no '{layout.pos_key}' (the {layout.display} layout's position embedding), so the "
                         "patch grid is unknown; the layout: " + layout.source)
    rows = int(table.shape[-2]) - dims["T"] - (1 if layout.unknown_row else 0)
    side = math.isqrt(max(rows, 0))
    if rows < 1 or side * side != rows:
        raise ModelError(f"{file}: '{layout.pos_key}' {tuple(table.shape)} leaves {rows} patch rows, not a square "
                         f"grid ({layout.display} layout: {_shape_text(layout.keys[layout.pos_key])})")
    return rows


def _size(symbol: str, dims: dict[str, int]) -> int:
    """``"D"``, ``"3*D"``, ``"N+1"``, ``"N+T"``, ``"1"`` -> the number."""
    m = re.fullmatch(r"(?:(\d+)\*)?([A-Z]|\d+)(?:\+(\d+|[A-Z]))?", symbol)
    if m is None:
        raise ValueError(f"bad shape symbol {symbol!r}")
    factor, base, plus = m.groups()
    value = int(base) if base.isdigit() else dims[base]
    extra = 0 if plus is None else int(plus) if plus.isdigit() else dims[plus]
    return int(factor or 1) * value + extra


def _shape_text(shape: Shape) -> str:
    return "(" + ", ".join(shape) + ("," if len(shape) == 1 else "") + ")"


def key_table(kept: Weights, layout: Layout, file: Path) -> dict[str, Shape]:
    """Every key the encoder must hold, with its symbolic shape; an unknown or a missing key is refused by name."""
    norms = [n for n in ("norm", "fc_norm") if f"{n}.weight" in kept]
    if len(norms) > 1:
        raise ModelError(f"{file}: both norm and fc_norm in the encoder; the {layout.display} layout has one ('norm' "
                         "before pooling, or 'fc_norm' after the average pooling of a --global_pool fine-tune)")
    depth = _depth(kept)
    if not depth:
        raise ModelError(f"{file}: no 'blocks.0.*' keys: not a {layout.display} encoder ({layout.source})"
                         f"{_hint({'model': kept}, layout)}")
    table = layout.encoder_keys(depth, norms[0] if norms else "norm", "head.weight" in kept)
    absent = {name for name in layout.optional if name not in kept and f"blocks.0.{name}" not in kept}
    table = {k: v for k, v in table.items() if k not in absent and k.split(".", 2)[-1] not in absent}
    unknown = [k for k in kept if k not in table]
    if unknown:
        raise ModelError(f"{file}: '{unknown[0]}' is not a key of the {layout.display} layout's encoder (nor dropped "
                         f"by one of its rules){f' ({len(unknown)} such keys)' if len(unknown) > 1 else ''}; the "
                         f"layout: {layout.source}{_hint({'model': kept}, layout)}")
    missing = [k for k in table if k not in kept]
    if missing:
        raise ModelError(f"{file}: missing '{missing[0]}' {_shape_text(table[missing[0]])}"
                         f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, a key of the "
                         f"{layout.display} layout's encoder ({layout.source})")
    return table


def check_shapes(kept: Weights, table: dict[str, Shape], layout: Layout, dims: dict[str, int], file: Path) -> None:
    """Every tensor has the shape the layout gives it at the widths the patch embedding and MLP imply."""
    for key, symbols in table.items():
        shape = tuple(_size(s, dims) for s in symbols)
        if tuple(kept[key].shape) != shape:
            raise ModelError(f"{file}: '{key}' has shape {tuple(kept[key].shape)}; the {layout.display} layout with "
                             f"embed_dim {dims['D']}, MLP {dims['H']}, patch {dims['P']}, {dims['N']} patches expects "
                             f"{shape} {_shape_text(symbols)}")


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


if __name__ == "__main__":
    sys.exit(main())
