"""Finding an encoder's weights in an authors' released file and checking them against its layout
(:mod:`patchplace.models.layouts`): the entry they sit in, every key used or dropped by a rule, the widths the
tensors imply, each tensor's shape at those widths, and floating-point, finite values — each refusal one line
naming the key and the layout expected."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from .convert_read import Weights
from .errors import ModelError
from .layouts import HEADS_BY_WIDTH, TRAINING_STATE, Layout, Shape


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
