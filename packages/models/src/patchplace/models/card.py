"""The model card (``README.md``) written into every checkpoint directory: Hugging Face front matter (library,
tags, datasets, pipeline) and what a reader needs — method and paper, backbone, data fingerprint, recipe, the
metrics the run measured, preprocessing, and how to load it with patchplace and with timm."""

from __future__ import annotations

import json
from typing import Any

from torch import nn

PAPERS = {
    "mp3": "Zhai et al. 2022, Position Prediction as an Effective Pretraining Strategy (MP3)",
    "droppos": "Wang et al. 2023, DropPos: Pre-Training Vision Transformers by Reconstructing Dropped Positions",
    "stop": "Bar et al. 2024, Stochastic positional embeddings improve masked image modeling (StoP)",
    "ijepa": "Assran et al. 2023, Self-Supervised Learning from Images with a Joint-Embedding Predictive Architecture",
    "mjp": "Ren et al. 2023, Masked Jigsaw Puzzle: A Versatile Position Embedding for Vision Transformers",
    "randsac": "Hua et al. 2022, Self-supervision through Random Segments with Autoregressive Coding (RandSAC)",
    "mae": "He et al. 2022, Masked Autoencoders Are Scalable Vision Learners",
}


def _method(metadata: dict[str, Any]) -> str:
    method = str(metadata.get("method", "unknown"))
    base = method.split(":", 1)[-1]
    pretrained = (metadata.get("pretrain_metadata") or {}).get("method", base)
    return str(pretrained if method.startswith("finetune:") else base)


def model_card(model: nn.Module, metadata: dict[str, Any], layout: str) -> str:
    """Markdown with YAML front matter for ``model`` (a patchplace backbone) and its checkpoint metadata."""
    c = model.config
    method = _method(metadata)
    data = metadata.get("data") or {}
    dataset = data.get("dataset") if isinstance(data, dict) else None
    params = sum(p.numel() for p in model.parameters())
    pipeline = ("image-classification" if c.num_classes else "image-feature-extraction") if c.modality == "image" \
        else ("audio-classification" if c.num_classes else "feature-extraction")
    tags = ["patchplace", "vision-transformer" if c.modality == "image" else "audio-transformer", method,
            f"pos-embed-{c.pos_embed}"] + (["timm"] if layout != "patchplace" else [])
    front = ["---", "library_name: patchplace", f"pipeline_tag: {pipeline}", "tags:", *[f"- {t}" for t in tags]]
    if dataset:
        front += ["datasets:", f"- {dataset}"]
    front.append("---")
    size = f"{c.image_hw[0]}x{c.image_hw[1]} px, patch {c.patch_size}, {c.in_chans} channel(s)" \
        if c.modality == "image" else f"{c.num_frames} MFCC frames x {c.in_features}"
    lines = [*front, "", f"# {metadata.get('method', method)} — patchplace {c.modality} backbone", "",
             f"- **Method**: {method}" + (f" — {PAPERS[method]}" if method in PAPERS else ""),
             f"- **Backbone**: {c.embed_dim} wide, {c.depth} deep, {c.num_heads} heads, {size}, PE `{c.pos_embed}`, "
             f"pool `{c.global_pool}`, {params / 1e6:.2f}M parameters, {c.num_classes or 'no'} classes",
             f"- **Data**: {dataset or 'unknown'}" + (f" (manifest fingerprint `{data['fingerprint']}`)"
                                                     if isinstance(data, dict) and data.get("fingerprint") else ""),
             f"- **Checkpoint step**: {metadata.get('step', 'unknown')}"]
    if metadata.get("classes"):
        lines.append(f"- **Classes**: {', '.join(map(str, metadata['classes']))}")
    norm = metadata.get("normalization")
    if norm:
        lines.append(f"- **Preprocessing**: pad to {metadata.get('pad_to') or 'none'}, scale to [0, 1], normalize "
                     f"mean {norm.get('mean')} std {norm.get('std')}")
    for title, key in (("Recipe", "recipe"), ("Metrics", "metrics")):
        lines += ["", f"## {title}", ""]
        if metadata.get(key):
            rows = _flat(metadata[key])
            lines += ["| field | value |", "|---|---|", *[f"| {k} | {json.dumps(v)} |" for k, v in rows.items()]]
        else:
            lines.append("Not recorded in this checkpoint" + (" (written before its evaluation)."
                                                             if key == "metrics" else "."))
    lines += ["", "## Load", "", "```python", "from patchplace.models import load_pretrained",
              "model, metadata = load_pretrained(\"path/to/this/directory\")", "```"]
    if layout != "patchplace":
        lines += ["", "With timm only (weights keyed as timm's model; identical outputs):", "", "```python",
                  "import timm", "model = timm.create_model(\"local-dir:path/to/this/directory\", pretrained=True)",
                  "```"]
    else:
        lines += ["", "timm has no equivalent of this backbone: load it with patchplace."]
    return "\n".join(lines) + "\n"


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix or "value": value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
