"""The model card (``README.md``) written into every checkpoint directory.

Front matter in the Hugging Face Hub's schema: ``license``, ``library_name``, ``pipeline_tag``, ``tags``,
``datasets``, ``base_model`` (a fine-tune's pretraining, when it is a Hub model id) and ``model-index`` (task,
dataset with the split the metrics were measured on, metrics; built with ``huggingface_hub``'s own
``EvalResult``). The body: method and paper, backbone, base model, data fingerprint, preprocessing (and whether
timm's transform reproduces it), recipe, the metrics with their split, and how to load it with patchplace and timm.

The Hub refuses a push whose ``base_model`` is not a model id on the Hub (a local path, a sha256), so a fine-tune of
a local checkpoint records that checkpoint under ``base_model_local`` (path as given to ``model.checkpoint``, weights
sha256, method) and writes ``base_model`` only from ``metadata["base_model"]`` — set it (``update_metadata(dir,
base_model="user/repo")``) once the pretraining checkpoint is on the Hub.
"""

from __future__ import annotations

import json
import re
from typing import Any

from huggingface_hub.repocard_data import EvalResult, eval_results_to_model_index
from huggingface_hub.utils import yaml_dump

from .config import BackboneConfig
from .errors import ModelError
from .timm_interop import describe_preprocessing, timm_preprocessing

# A checkpoint's license: metadata["license"], set with update_metadata(dir, license="mit"), else DEFAULT_LICENSE
# (the license packages/models/README.md states for the weights patchplace writes). A license not among the Hub's
# ids is written as the Hub's spec asks (hf.co/docs/hub/model-cards): license: other, license_name (an id for it)
# and license_link (a URL, or LICENSE for a file beside the card) — metadata["license_name"] / ["license_link"].
DEFAULT_LICENSE = "apache-2.0"
# the Hub's license ids (https://huggingface.co/docs/hub/repositories-licenses)
HUB_LICENSES = frozenset((
    "apache-2.0", "mit", "openrail", "bigscience-openrail-m", "creativeml-openrail-m", "bigscience-bloom-rail-1.0",
    "bigcode-openrail-m", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd", "bsd-2-clause", "bsd-3-clause",
    "bsd-3-clause-clear", "c-uda", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5", "cc-by-3.0", "cc-by-4.0", "cc-by-sa-3.0",
    "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0", "cc-by-nd-4.0", "cc-by-nc-nd-3.0",
    "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0", "cc-by-nc-sa-4.0", "cdla-sharing-1.0",
    "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl", "ecl-2.0", "epl-1.0", "epl-2.0", "etalab-2.0", "eupl-1.1",
    "agpl-3.0", "gfdl", "gpl", "gpl-2.0", "gpl-3.0", "lgpl", "lgpl-2.1", "lgpl-3.0", "isc", "lppl-1.3c", "ms-pl",
    "mpl-2.0", "odc-by", "odbl", "openrail++", "osl-3.0", "postgresql", "ofl-1.1", "ncsa", "unlicense", "zlib",
    "pddl", "lgpl-lr", "deepfloyd-if-license", "llama2", "llama3", "llama3.1", "llama3.2", "llama3.3", "gemma",
    "unknown", "other"))
LICENSE_NAME = re.compile(r"^[a-z0-9][a-z0-9.+-]*$")  # license_name: an id, e.g. my-license-1.0
LICENSE_LINK = re.compile(r"^(https?://\S+|[\w.-]+(/[\w.-]+)*)$")  # a URL, or a file in the repository (LICENSE)

# metric key -> (model-index type, pretty name) for a classifier's evaluation; other keys keep their own name
CLASSIFIER_METRICS = {"top1": ("accuracy", "top-1 accuracy"), "top5": ("top_5_accuracy", "top-5 accuracy"),
                      "loss": ("loss", "cross-entropy loss")}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "namespace/name"


def license_fields(metadata: dict[str, Any]) -> dict[str, str]:
    """The card's license front matter: ``{"license": id}`` for a Hub license id (``metadata["license"]``, else
    :data:`DEFAULT_LICENSE`); another license as ``license: other`` with ``license_name`` (``metadata["license_name"]``
    or the license given) and ``license_link`` (``metadata["license_link"]``). Raises :class:`ModelError` when
    those are missing or malformed (:func:`license_problems`), with how to set them."""
    given = str(metadata.get("license") or DEFAULT_LICENSE).strip()
    if given.lower() in HUB_LICENSES and given.lower() != "other":
        return {"license": given.lower()}
    name = metadata.get("license_name") or (given if given.lower() != "other" else None)
    fields = {"license": "other", "license_name": str(name or ""), "license_link": str(metadata.get("license_link")
                                                                                    or "")}
    if problems := license_problems(fields):
        raise ModelError(f"license {given!r}: {'; '.join(problems)} — a license not among the Hub's ids "
                         "(https://huggingface.co/docs/hub/repositories-licenses) needs license_name (e.g. "
                         "my-license-1.0) and license_link (a URL, or LICENSE for a file beside the card): "
                         "update_metadata(dir, license='other', license_name=..., license_link=...)")
    return fields


def license_problems(front: dict[str, Any]) -> list[str]:
    """What makes a card's license front matter invalid by the Hub's spec (hf.co/docs/hub/model-cards): ``license``
    one of :data:`HUB_LICENSES`; ``license: other`` with a ``license_name`` id and a ``license_link`` (URL or a file
    in the repository); ``license_name`` / ``license_link`` only with ``other``. [] when valid."""
    license_ = front.get("license")
    if license_ not in HUB_LICENSES:
        return [f"license {license_!r} is not one of the Hub's license ids"]
    if license_ != "other":
        extra = [k for k in ("license_name", "license_link") if k in front]
        return [f"{', '.join(extra)} given with license {license_} (only license: other takes them)"] if extra else []
    problems = []
    if not LICENSE_NAME.match(str(front.get("license_name") or "")):
        problems.append(f"license_name {front.get('license_name')!r} is not an id (lowercase letters, digits, "
                        "'.', '-', '+')")
    if not LICENSE_LINK.match(str(front.get("license_link") or "")):
        problems.append(f"license_link {front.get('license_link')!r} is not a URL or a file path")
    return problems


def card_license(metadata: dict[str, Any]) -> str:
    """The checkpoint's license as one string (timm's ``pretrained_cfg``, the card's body): the Hub id, or the
    ``license_name`` of a license ``other`` (:func:`license_fields`)."""
    fields = license_fields(metadata)
    return fields.get("license_name") or fields["license"]


def _method(metadata: dict[str, Any]) -> str:
    method = str(metadata.get("method", "unknown"))
    base = method.split(":", 1)[-1]
    pretrained = (metadata.get("pretrain_metadata") or {}).get("method", base)
    return str(pretrained if method.startswith("finetune:") else base)


def _paper(metadata: dict[str, Any]) -> str | None:
    """The paper of the card's method (:func:`_method`), as the pretraining recorded it (``metadata["paper"]``,
    written by the pipeline from the method's registration: this package knows no method)."""
    source = metadata.get("pretrain_metadata") if str(metadata.get("method", "")).startswith("finetune:") \
        else metadata
    paper = (source or {}).get("paper")
    return str(paper) if paper else None


def _pipeline_tag(config: BackboneConfig) -> str:
    if config.modality == "image":
        return "image-classification" if config.num_classes else "image-feature-extraction"
    return "audio-classification" if config.num_classes else "feature-extraction"


def _dataset(metadata: dict[str, Any]) -> str | None:
    data = metadata.get("data")
    return data.get("dataset") if isinstance(data, dict) else None


def base_model(metadata: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """(the Hub model id a fine-tune started from, or None; what is known of a local pretraining checkpoint, or None).

    ``metadata["base_model"]`` is the Hub id when someone set it; ``pretrained_from`` (the ``model.checkpoint``
    path as given), ``pretrained`` (the sha256 of its weights) and ``pretrain_metadata`` describe a local one."""
    hub_id = metadata.get("base_model")
    hub_id = str(hub_id) if hub_id and HUB_ID.match(str(hub_id)) else None
    local = {k: v for k, v in (("checkpoint", metadata.get("pretrained_from")), ("weights", metadata.get("pretrained")),
                               ("method", (metadata.get("pretrain_metadata") or {}).get("method")),
                               ("step", (metadata.get("pretrain_metadata") or {}).get("step"))) if v is not None}
    return hub_id, (local if local.get("checkpoint") or local.get("weights") else None)


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def eval_results(config: BackboneConfig, metadata: dict[str, Any]) -> list[EvalResult]:
    """The checkpoint's metrics as ``huggingface_hub`` ``EvalResult`` s (the card's ``model-index``), each with the
    split it was measured on (``metadata["metrics_split"]``). The sample count is not a metric; text values are
    left to the body."""
    metrics = metadata.get("metrics") or {}
    classifier = bool(config.num_classes)
    method = _method(metadata)
    dataset = _dataset(metadata) or "unknown"
    split = metadata.get("metrics_split")
    out = []
    for key, value in metrics.items():
        if key == "count" or not _numeric(value):
            continue
        kind, name = CLASSIFIER_METRICS.get(key, (key, key)) if classifier else (key, f"{method} pretext {key}")
        out.append(EvalResult(
            task_type=_pipeline_tag(config),
            task_name="Classification" if classifier else f"{method} pretraining objective",
            dataset_type=dataset, dataset_name=dataset, dataset_split=str(split) if split else None,
            metric_type=kind, metric_value=float(value), metric_name=name))
    return out


def front_matter(config: BackboneConfig, metadata: dict[str, Any], layout: str) -> dict[str, Any]:
    """The card's YAML front matter as a dict (Hub schema, in reading order)."""
    method = _method(metadata)
    tags = ["patchplace", "vision-transformer" if config.modality == "image" else "audio-transformer", method,
            f"pos-embed-{config.pos_embed}"] + (["timm"] if layout != "patchplace" else [])
    front: dict[str, Any] = {**license_fields(metadata), "library_name": "patchplace",
                             "pipeline_tag": _pipeline_tag(config), "tags": tags}
    if _dataset(metadata):
        front["datasets"] = [_dataset(metadata)]
    hub_id, local = base_model(metadata)
    if hub_id:
        front["base_model"] = hub_id
    if local:
        front["base_model_local"] = local
    results = eval_results(config, metadata)
    if results:
        name = f"patchplace {metadata.get('method', method)} {config.modality} backbone"
        front["model-index"] = eval_results_to_model_index(name, results)
    return front


def model_card(config: BackboneConfig, metadata: dict[str, Any], layout: str, num_params: int) -> str:
    """Markdown with YAML front matter for a patchplace backbone (its config and parameter count) and its checkpoint
    metadata; ``layout``: the weights' layout (:func:`~patchplace.models.timm_interop.timm_layout`)."""
    c = config
    method = _method(metadata)
    dataset = _dataset(metadata)
    data = metadata.get("data") or {}
    size = f"{c.image_hw[0]}x{c.image_hw[1]} px, patch {c.patch_size}, {c.in_chans} channel(s)" \
        if c.modality == "image" else f"{c.num_frames} MFCC frames x {c.in_features}"
    lines = ["---", yaml_dump(front_matter(c, metadata, layout), sort_keys=False).strip(), "---", "",
             f"# {metadata.get('method', method)} — patchplace {c.modality} backbone", "",
             f"- **Method**: {method}" + (f" — {_paper(metadata)}" if _paper(metadata) else ""),
             f"- **Backbone**: {c.embed_dim} wide, {c.depth} deep, {c.num_heads} heads, {size}, PE `{c.pos_embed}`, "
             f"pool `{c.global_pool}`{' + fc_norm' if c.fc_norm else ''}, {num_params / 1e6:.2f}M parameters, "
             f"{c.num_classes or 'no'} classes"]
    hub_id, local = base_model(metadata)
    if hub_id or local:
        lines.append("- **Base model**: " + _base_model_line(hub_id, local))
    lines += [f"- **Data**: {dataset or 'unknown'}" + (f" (manifest fingerprint `{data['fingerprint']}`)"
                                                      if isinstance(data, dict) and data.get("fingerprint") else ""),
              f"- **Checkpoint step**: {metadata.get('step', 'unknown')}",
              f"- **License**: {_license_line(metadata)}"]
    if metadata.get("classes"):
        lines.append(f"- **Classes**: {', '.join(map(str, metadata['classes']))}")
    gap = None
    if c.modality == "image":
        _, gap = timm_preprocessing(c, metadata)
        timm_note = "" if layout == "patchplace" else (
            " — timm's eval transform reproduces it exactly (`pretrained_cfg`)" if gap is None else
            f" — timm's eval transform does **not** reproduce it ({gap}): use `patchplace.models.timm_transform`")
        lines.append(f"- **Preprocessing** (evaluation): {describe_preprocessing(c, metadata)}{timm_note}")
    lines += ["", "## Recipe", ""]
    if metadata.get("recipe"):
        rows = _flat(metadata["recipe"])
        lines += ["| field | value |", "|---|---|", *[f"| {k} | {json.dumps(v)} |" for k, v in rows.items()]]
    else:
        lines.append("Not recorded in this checkpoint.")
    lines += ["", "## Metrics", "", *_metrics_section(c, metadata, dataset)]
    lines += ["", "## Load", "", "```python", "from patchplace.models import load_pretrained",
              "model, metadata = load_pretrained(\"path/to/this/directory\")"]
    if c.modality == "image" and metadata.get("normalization"):
        lines += ["from patchplace.models import timm_transform",
                  "transform = timm_transform(\"path/to/this/directory\")  # PIL image -> the input it was "
                  "evaluated on"]
    lines.append("```")
    if layout != "patchplace":
        lines += ["", "With timm only (weights keyed as timm's model; identical outputs):", "", "```python",
                  "import timm", "model = timm.create_model(\"local-dir:path/to/this/directory\", pretrained=True)"]
        lines += ["transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))"
                  + ("  # = ours, exactly" if gap is None else "  # NOT ours here: see Preprocessing above")]
        lines.append("```")
    else:
        lines += ["", "timm has no equivalent of this backbone: load it with patchplace."]
    return "\n".join(lines) + "\n"


def _license_line(metadata: dict[str, Any]) -> str:
    fields = license_fields(metadata)
    if fields["license"] != "other":
        return fields["license"]
    return f"{fields['license_name']} ({fields['license_link']})"


def _base_model_line(hub_id: str | None, local: dict[str, Any] | None) -> str:
    parts = [f"[{hub_id}](https://huggingface.co/{hub_id})"] if hub_id else []
    if local:
        what = f"pretraining checkpoint `{local['checkpoint']}`" if local.get("checkpoint") else (
            "a pretraining checkpoint whose path was not recorded (identify it by its weights' sha256)")
        extra = [f"{local['method']}" if local.get("method") else None,
                 f"step {local['step']}" if local.get("step") is not None else None,
                 f"weights `{local['weights']}`" if local.get("weights") else None]
        parts.append(what + (f" ({', '.join(e for e in extra if e)})" if any(extra) else ""))
    return "; ".join(parts)


def _metrics_section(config: BackboneConfig, metadata: dict[str, Any], dataset: str | None) -> list[str]:
    metrics = metadata.get("metrics")
    if not metrics:
        return ["Not recorded in this checkpoint (written before its evaluation)."]
    split = metadata.get("metrics_split")
    where = (f"the `{split}` split" if split else "a split this checkpoint does not record") \
        + f" of {dataset or 'its dataset'}"
    count = metrics.get("count")
    which = (f"the best evaluation by {metadata['best_metric']}" if metadata.get("best_metric")
             else "the run's closing evaluation")
    what = ("the classifier's" if config.num_classes else
            f"the {_method(metadata)} objective's own (pretext task, not a classification)")
    head = (f"{which.capitalize()} at step {metadata.get('step', 'unknown')}, on {where}"
            + (f" ({count} samples)" if _numeric(count) else "") + f": {what} metrics.")
    rows = [f"| {k} | {json.dumps(v)} | {split or 'not recorded'} |" for k, v in _flat(metrics).items()
            if k != "count"]
    return [head, "", "| metric | value | split |", "|---|---|---|", *rows]


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix or "value": value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
