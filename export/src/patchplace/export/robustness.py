"""Corruption robustness by the ImageNet-C protocol ("Benchmarking Neural Network Robustness to Common Corruptions
and Perturbations", Hendrycks & Dietterich, arXiv:1903.12261): seeded corruptions, identical for every model and
cached with the record of what they are, errors per corruption and severity, CE / mCE over a reference model."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .errors import ExportError, Unavailable
from .ort_model import OnnxModel

IMAGENET_C = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
              "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
              "jpeg_compression")


def corrupt_batch(images: torch.Tensor, name: str, severity: int) -> torch.Tensor:
    """imagecorruptions on uint8 (B, C, H, W), ``glass_blur`` / ``fog`` mended for NumPy 2 / scikit-image >= 0.19
    (:mod:`.corruptions`); gray images go through RGB and back (ITU-R 601 luma)."""
    from .corruptions import corrupt

    if min(images.shape[-2:]) < 32:
        raise Unavailable(f"imagecorruptions needs images of at least 32 px, got {tuple(images.shape[-2:])}: pad "
                          "or resize them (Fashion-MNIST is padded to 32)")
    out = []
    for image in images:
        hwc = image.permute(1, 2, 0).numpy()
        rgb = np.repeat(hwc, 3, axis=2) if hwc.shape[2] == 1 else hwc
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = np.asarray(corrupt(rgb, corruption_name=name, severity=severity), dtype=np.float32)
        if hwc.shape[2] == 1:
            c = (c @ np.array([0.299, 0.587, 0.114], dtype=np.float32))[..., None]
        out.append(torch.from_numpy(np.clip(c, 0, 255).round().astype(np.uint8)).permute(2, 0, 1))
    return torch.stack(out)


CACHE_FORMAT = 1  # the layout of a --corruption-cache file (.npz: "images" uint8, "meta" its JSON record)


def corrupted_images(images: torch.Tensor, name: str, severity: int, cache: Path | None = None) -> torch.Tensor:
    """``corrupt_batch`` with a fixed NumPy seed per (corruption, severity), so every model sees the same corrupted
    images; with ``cache`` the uint8 result is stored there (``<name>-<severity>-<n>-<digest>.npz``, written
    atomically and flushed to the disk) with the record of what it is (the source images' sha256, corruption,
    severity) and its own sha256, and reused by the next model evaluated on the same images only when all of them
    match: a damaged, zero-filled or misplaced file is said in one line and computed again."""
    source = hashlib.sha256(images.numpy().tobytes()).hexdigest()
    file = cache / f"{name}-{severity}-{len(images)}-{source[:16]}.npz" if cache else None
    if file is not None and file.exists():
        cached, problem = read_cached(file, images, {"corruption": name, "severity": severity,
                                                     "source_sha256": source})
        if cached is not None:
            return cached
        print(f"[ort-eval] corruption cache {file}: {problem}; computed again", file=sys.stderr, flush=True)
    state = np.random.get_state()
    np.random.seed(zlib.crc32(f"{name}/{severity}".encode()))
    try:
        out = corrupt_batch(images, name, severity)
    finally:
        np.random.set_state(state)
    if file is not None:
        meta = {"format": CACHE_FORMAT, "corruption": name, "severity": severity, "source_sha256": source,
                "images_sha256": hashlib.sha256(out.numpy().tobytes()).hexdigest()}
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, images=out.numpy(), meta=np.array(json.dumps(meta)))
            f.flush()
            os.fsync(f.fileno())  # a crash after the rename leaves the whole file, not zeros
        os.replace(tmp, file)
    return out


def read_cached(file: Path, images: torch.Tensor, expected: dict[str, Any]) -> tuple[torch.Tensor | None, str]:
    """(the corrupted images a cache file holds, "") when its record matches ``expected`` (source sha256,
    corruption, severity) and its images their recorded sha256; else (None, what is wrong)."""
    try:
        data = np.load(file, allow_pickle=False)  # never unpickles
        if not isinstance(data, np.lib.npyio.NpzFile):  # a bare array (.npy): no record of what it is
            return None, "not a cache file of this version (no record of what it holds)"
        with data:
            meta, pixels = json.loads(str(data["meta"])), np.asarray(data["images"])
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:  # JSONDecodeError: a ValueError
        try:
            zeros = file.is_file() and not file.read_bytes().strip(b"\0")
        except OSError:
            zeros = False
        return None, "all zero bytes (zero-filled by a crash?)" if zeros else \
            f"not a readable cache file ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
        return None, "not a cache file of this version (no record of what it holds)"
    for key, value in expected.items():
        if meta.get(key) != value:
            return None, f"made from other images or another corruption ({key} {meta.get(key)!r}, here {value!r})"
    if pixels.dtype != np.uint8 or pixels.shape != tuple(images.shape):
        return None, f"holds {pixels.dtype} {pixels.shape}, not uint8 {tuple(images.shape)}"
    if hashlib.sha256(pixels.tobytes()).hexdigest() != meta.get("images_sha256"):
        zeros = " (all zero: zero-filled by a crash?)" if not pixels.any() else ""
        return None, f"its images do not match the sha256 it records{zeros}: damaged"
    if not pixels.any() and images.numpy().any():
        return None, "its images are all zero while the source images are not"
    return torch.from_numpy(pixels), ""


def robustness(model: OnnxModel, images: torch.Tensor, labels: torch.Tensor, batch_size: int,
               corruptions=IMAGENET_C, severities=(1, 2, 3, 4, 5),
               reference: dict[str, float] | None = None, cache: Path | None = None) -> dict[str, Any]:
    """ImageNet-C protocol on the padded images: error per corruption (mean over severities); corruptions that
    fail in this environment are listed, not faked; CE / mCE when reference errors are given. The corrupted
    images are seeded per (corruption, severity) — identical for every model — and cached in ``cache`` if given."""
    errors, failed = {}, {}
    padded = model.pad(images)
    for name in tqdm(corruptions, desc="corruptions", leave=False):
        try:
            per_severity = []
            for severity in severities:
                corrupted = corrupted_images(padded, name, severity, cache)
                wrong = 0
                for x, y in zip(corrupted.split(batch_size), labels.split(batch_size), strict=True):
                    logits, _ = model.run(model.normalize(x))
                    wrong += int((torch.from_numpy(logits).argmax(1) != y).sum())
                per_severity.append(wrong / len(labels))
            errors[name] = {"error": statistics.mean(per_severity), "per_severity": per_severity}
        except ExportError:
            raise
        except Exception as exc:  # e.g. glass_blur / fog under NumPy 2 / new scikit-image
            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
    mean_error = statistics.mean(e["error"] for e in errors.values()) if errors else float("nan")
    result: dict[str, Any] = {"errors": errors, "ran": sorted(errors), "failed": failed, "mean_error": mean_error}
    if reference:
        result.update(corruption_errors(errors, reference, corruptions))
    return result


def reference_errors(reference: dict[str, Any]) -> dict[str, float | list[float]]:
    """A reference model's errors per corruption from any of the JSONs that hold them: ``{name: error}``, ``{name:
    [error per severity]}``, a ``robustness.errors`` (``{name: {"error", "per_severity"}}``) or a whole
    ``results.json`` of this evaluator. -> {name: per-severity list where known, else the mean error}."""
    if isinstance(reference.get("robustness"), dict):
        reference = reference["robustness"]
    if isinstance(reference.get("errors"), dict):
        reference = reference["errors"]
    out: dict[str, float | list[float]] = {}
    for name, value in reference.items():
        if isinstance(value, dict):
            value = value.get("per_severity") or value.get("error")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            out[name] = [float(v) for v in value]
    return out


def corruption_errors(errors: dict[str, Any], reference: dict[str, Any],
                      corruptions=IMAGENET_C) -> dict[str, Any]:
    """ImageNet-C's normalisation (Hendrycks & Dietterich 2019): ``CE_c = sum_s E_{s,c} / sum_s E^ref_{s,c}`` over the
    5 severities (the reference: AlexNet in the paper, here the model whose errors ``--reference-errors`` gives),
    ``mCE = mean_c CE_c`` over all 15 corruptions — reported only when every one ran here and has a reference error
    (``mce_partial``, the mean over those that did, and ``mce_missing`` otherwise: a 13-corruption mean is not mCE).
    A reference without per-severity errors gives ``mean E / mean E^ref`` (equal when both have 5 severities)."""
    ref = reference_errors(reference)
    ce: dict[str, float] = {}
    for name, e in errors.items():
        base = ref.get(name)
        if isinstance(base, list) and len(base) == len(e["per_severity"]):
            num, den = sum(e["per_severity"]), sum(base)
        elif base is not None:
            num, den = e["error"], statistics.mean(base) if isinstance(base, list) else base
        else:
            continue
        if den > 0:
            ce[name] = num / den
    missing = [n for n in corruptions if n not in ce]
    mean_ce = statistics.mean(ce.values()) if ce else None
    return {"ce": ce, "mce": None if missing else mean_ce, "mce_partial": mean_ce if missing else None,
            "mce_missing": missing, "mce_definition": "CE_c = sum over severities of error / sum of the reference's "
                                                      f"error; mCE = mean of CE_c over the {len(corruptions)} "
                                                      "ImageNet-C corruptions"}
