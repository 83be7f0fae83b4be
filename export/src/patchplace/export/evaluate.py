"""Evaluate an exported ONNX model with ONNX Runtime on shards: accuracy, MJP consistency / Diff. Norm,
corruption robustness (ImageNet-C protocol) and latency.

    python -m patchplace.export.evaluate model.onnx --data shards/fashion_mnist/test \\
        --out runs/ort_eval \\
        [--checkpoint runs/x/checkpoint]      # also time PyTorch eager on the same inputs
        [--reference-errors supervised.json]  # mCE: corruption errors over a reference model's

Writes ``results.json``, ``results.md`` and PNG curves into ``--out`` (checked before any work: a
place that cannot be written is one line). Providers (``--provider``): ``auto`` (CUDA when torch
sees a GPU and ONNX Runtime has the CUDA provider, else CPU), ``cpu``, or ``cuda`` — then the
session must run on CUDAExecutionProvider (onnxruntime-gpu; ONNX Runtime falls back to the CPU
silently when the CUDA libraries do not load) or the evaluation stops with one line, and PyTorch
runs on the same GPU. With ``--checkpoint``: parity (max abs logit difference, argmax agreement,
top-1 of both) on the evaluated images, PyTorch on the provider's device; and PyTorch eager timed
beside ONNX Runtime (CUDA-synchronised on a GPU, where ONNX Runtime is also timed with its inputs
and outputs bound on the GPU: ``onnxruntime_iobinding``). ``--corruption-cache``: each corrupted
image set is stored with the fingerprint of its source images, its corruption and severity and its
own checksum; a file that does not match them (damaged, zero-filled, another set's) is said in one
line and computed again.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.export.evaluate`, before the imports below load torch: the
    # arguments parse torch-free (--help, usage errors), then this module, imported by its name, runs them
    from patchplace.export import cli

    sys.exit(cli.evaluate())

import argparse
import errno
import hashlib
import json
import os
import platform
import shlex
import statistics
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from patchplace.data import DataError, Manifest, ShardDataset, make_loader
from patchplace.data.manifest import class_list, first_difference
from patchplace.finetune import consistency_curve

from .choices import PROVIDERS
from .cli import evaluate_parser
from .exporter import (
    INT8_SUFFIX,
    Classifier,
    ExportError,
    Unavailable,
    check_writable,
    copy_suffix,
    fp32_of,
    load_export,
    non_finite,
    ort,
)

CONSISTENCY_RATIOS = (0.03, 0.09, 0.15, 0.27, 0.5)  # MJP Table 1 uses 0.15, Fig. 3 the curve
SIDECAR_FORMATS = ("patchplace.export/1",)  # the model.json layouts this evaluator reads
CUDA_LIBRARIES = "libcublas(Lt).so.13, libcudart.so.13, libcurand.so.10, cuDNN 9"
IMAGENET_C = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
              "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
              "jpeg_compression")


def ort_package() -> str:
    """``onnxruntime-gpu 1.31.1`` / ``onnxruntime 1.30.0``: the ONNX Runtime build imported (not the one pip lists)."""
    try:
        from onnxruntime.capi.build_and_package_info import package_name
    except ImportError:
        package_name = "onnxruntime"
    return f"{package_name} {ort.__version__}"


def prepare_provider(provider: str) -> None:
    """Before a CUDA session: refuse at once when nothing can give one (no GPU, or a CPU build of ONNX Runtime), and
    load the CUDA / cuDNN libraries (``onnxruntime.preload_dlls``, ONNX Runtime >= 1.21; torch is imported first,
    so the libraries of its nvidia-* packages are found)."""
    if provider != "cuda":
        return
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise ExportError(f"CUDAExecutionProvider not active: {ort_package()} (from {Path(ort.__file__).parent}) "
                          f"has no CUDA provider (available: {', '.join(available)}): replace onnxruntime with "
                          "onnxruntime-gpu (pip uninstall onnxruntime, then pip install onnxruntime-gpu: "
                          "patchplace-export[gpu]), or evaluate on the CPU with --provider cpu")
    if not torch.cuda.is_available():
        raise ExportError("CUDAExecutionProvider not active: torch sees no CUDA device here (no GPU, or no driver)")
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    import onnx  # a one-node graph: does a CUDA session come up at all (it raises or falls back to the CPU if not)?

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    probe = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])],
                                                          "probe", [x], [y]),
                                   opset_imports=[onnx.helper.make_opsetid("", 17)])
    try:
        session = ort.InferenceSession(probe.SerializeToString(), providers=PROVIDERS["cuda"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"CUDAExecutionProvider not active: ONNX Runtime could not create a CUDA session "
                          f"({' '.join(str(exc).split())[:300]}; {ort_package()}; {CUDA_FIX})") from None
    check_provider(session, "cuda")


CUDA_FIX = (f"onnxruntime-gpu could not load its CUDA libraries ({CUDA_LIBRARIES}): import torch first, call "
            "onnxruntime.preload_dlls(), or put the nvidia/*/lib directories of torch's nvidia-* packages on "
            "LD_LIBRARY_PATH; ONNX Runtime's log above names the library")


def check_provider(session: Any, provider: str) -> None:
    """Refuse a session that does not run on the provider asked for: ONNX Runtime falls back to the CPU without an
    error when the CUDA provider's libraries fail to load."""
    wanted = PROVIDERS.get(provider)
    got = session.get_providers()
    if wanted and got[0] != wanted[0]:
        why = CUDA_FIX if wanted[0].startswith("CUDA") else "the provider asked for is not available in this build"
        raise ExportError(f"{wanted[0]} not active: the session runs on {got[0]} ({ort_package()}; {why})")


class OnnxModel:
    """An exported classifier: its session (``threads`` intra-op threads, 0: ONNX Runtime's default; ``provider``:
    auto / cpu / cuda, see :data:`PROVIDERS` — a session not on the provider asked for is refused), sidecar and
    the preprocessing the sidecar describes. The pair is checked (:func:`~.exporter.load_export`): a model.onnx
    beside another export's model.json is refused; so are non-finite outputs, by :meth:`run`."""

    def __init__(self, path: str | Path, threads: int = 0, provider: str = "auto") -> None:
        if provider not in PROVIDERS:
            raise ExportError(f"provider must be one of {list(PROVIDERS)}, got {provider!r}")
        self.path = path = Path(path)
        prepare_provider(provider)
        self.meta, self.session = load_export(path, providers=PROVIDERS[provider], threads=threads)
        if self.meta.get("format") not in SIDECAR_FORMATS:  # another layout: its fields would be misread
            raise ExportError(f"{path.with_suffix('.json')} has format {self.meta.get('format')!r}, and this evaluator "
                              f"reads {', '.join(SIDECAR_FORMATS)}: evaluate it with the patchplace.export that wrote "
                              f"it, or re-export the checkpoint with this one (python -m patchplace.export CHECKPOINT "
                              f"--out {path})")
        check_provider(self.session, provider)
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        if self.meta.get("kind") != "classifier" or self.meta.get("modality") != "image":
            raise ExportError(f"{path}: this evaluator takes image classifiers, got {self.meta.get('modality')} "
                              f"{self.meta.get('kind')}")
        if self.meta.get("outputs") != ["logits", "pooled"]:
            raise ExportError(f"{path} has outputs {self.meta.get('outputs')}, expected ['logits', 'pooled']: "
                              "re-export it with this version of patchplace.export")
        self.inputs = [i["name"] for i in self.meta["inputs"]]
        self.channels, self.height, self.width = self.meta["inputs"][0]["shape"][1:]
        self.patch_size = self.meta["backbone"]["patch_size"]
        norm = self.meta.get("normalization") or {"mean": [0.5] * self.channels, "std": [0.5] * self.channels}
        self.mean = torch.tensor(norm["mean"]).view(1, -1, 1, 1)
        self.std = torch.tensor(norm["std"]).view(1, -1, 1, 1)
        # the checkpoint's evaluation transform (exports since it was recorded); older sidecars: pad / refuse
        self.eval_transform = (self.meta.get("preprocessing") or {}).get("eval_transform") or {}
        self.resizes = self.eval_transform.get("mode") == "resize_center_crop"

    def check_data(self, manifest: Manifest) -> None:
        """Refuse shards the model was not made for (class names and their order, channels, image size)."""
        classes = self.meta.get("classes") or []
        if classes and list(classes) != list(manifest.classes):  # label i must mean the class the model's i means
            dataset = ((self.meta.get("provenance") or {}).get("data") or {}).get("dataset") or "its training data"
            raise ExportError(f"the model's classes are {class_list(classes)} ({dataset}) but "
                              f"{manifest.dataset}/{manifest.split} holds {class_list(manifest.classes)} "
                              f"({first_difference(classes, manifest.classes)}): a top-1 would compare unrelated "
                              "labels; evaluate it on the dataset it was trained on")
        where = f"--data {manifest.location} ({manifest.dataset}/{manifest.split})"
        if manifest.modality != "image":
            raise ExportError(f"{where} holds {manifest.modality} but {self.path} is an image classifier: evaluate it "
                              "on an image split")
        channels = int(manifest.info.get("channels", 3))
        if channels != self.channels:
            kinds = {1: "grayscale", 3: "RGB"}
            raise ExportError(f"{where} holds {kinds.get(channels, 'multi-channel')} images ({channels} channel(s)) "
                              f"but {self.path} takes {kinds.get(self.channels, 'multi-channel')} ones "
                              f"({self.channels} channel(s)): evaluate it on a split written with {self.channels} "
                              "channel(s), as it was trained on")
        if self.resizes:  # any size: resized and centre-cropped as the checkpoint's evaluation transform does
            return
        native = manifest.info.get("image_size") or []
        if not native and not self.meta.get("pad_to"):
            raise ExportError(f"the shards of {manifest.dataset}/{manifest.split} hold images of varying sizes (no "
                              f"image_size in their manifest), and this evaluator only pads to the model's "
                              f"{self.height}x{self.width} input (no resize / centre crop): evaluate it on data of "
                              "one size it was trained on")
        if native and (native[0] > self.height or native[1] > self.width):
            # padding never crops: these images would be centre-cropped to the model's input (a silent wrong top-1)
            raise ExportError(f"the shards of {manifest.dataset}/{manifest.split} hold {native[0]}x{native[1]} "
                              f"images, larger than the model's {self.height}x{self.width} input: evaluate it on "
                              "data of the size it was trained on")
        side = self.meta.get("pad_to") or max(native or [0])
        if side != self.height:
            raise ExportError(f"{where} gives {side} px images after padding but {self.path} takes "
                              f"{self.height}x{self.width} pixels: evaluate it on data of the size it was trained on")

    def resize_crop(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 (C, h, w) -> uint8 (C, H, W) by the recorded evaluation transform: PIL resize (its interpolation)
        of the short side to ``floor(H / crop_pct)`` (as torchvision's ``Resize(int)`` computes the long side),
        centre crop as torchvision's ``CenterCrop`` — :mod:`.preprocess`'s numpy reference, the one the docs' ONNX
        Runtime snippet runs; :meth:`normalize` then gives timm's eval tensor bit for bit."""
        from .preprocess import center_crop, resize_short_side

        record = self.eval_transform
        try:
            resized = resize_short_side(image.numpy(), int(record["resize_short_side"]),
                                        record.get("interpolation", "bicubic"))
            cropped = center_crop(resized, self.height, self.width)
        except ValueError as exc:
            raise ExportError(f"{exc} (the evaluation transform of {self.path})") from None
        return torch.from_numpy(np.ascontiguousarray(cropped))

    def pad(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, h, w) -> uint8 (B, C, H, W), zero-padded and centered like the data path's PadTo."""
        h, w = images.shape[-2:]
        top, left = (self.height - h) // 2, (self.width - w) // 2
        return F.pad(images, (left, self.width - w - left, top, self.height - h - top))

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255.0 - self.mean) / self.std

    def run(self, pixels: torch.Tensor, unknown_pos: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
        feed = {"pixels": pixels.numpy().astype(np.float32)}
        if "unknown_pos" in self.inputs:
            feed["unknown_pos"] = (unknown_pos if unknown_pos is not None else torch.zeros(
                pixels.shape[0], (self.height // self.patch_size) * (self.width // self.patch_size),
                dtype=torch.bool)).numpy()
        logits, pooled = self.session.run(None, feed)
        for name, value in (("logits", logits), ("pooled", pooled)):
            if kind := non_finite(value):
                raise ExportError(f"{self.path}: the model's {name} hold {kind} on {len(value)} inputs: its weights "
                                  "are damaged or its training diverged; re-export it from a good checkpoint (no "
                                  "top-1 is reported)")
        return logits, pooled

    def _device_zeros(self, batch: int, device: torch.device) -> torch.Tensor:
        """An all-False ``unknown_pos`` on the GPU per batch size, made once and synchronised (ONNX Runtime reads it
        on its own stream)."""
        cache = self.__dict__.setdefault("_unknown", {})
        if batch not in cache:
            positions = (self.height // self.patch_size) * (self.width // self.patch_size)
            cache[batch] = torch.zeros(batch, positions, dtype=torch.bool, device=device)
            torch.cuda.synchronize(device)
        return cache[batch]

    def run_on_device(self, pixels: torch.Tensor) -> Any:
        """One forward with the input and outputs bound on the GPU (IOBinding; ``pixels``: a CUDA tensor): ONNX
        Runtime without the host copies, as PyTorch eager runs on the same GPU. -> the binding (outputs on the GPU)."""
        pixels = pixels.contiguous()
        binding = self.session.io_binding()
        index = pixels.device.index or 0
        binding.bind_input("pixels", "cuda", index, np.float32, tuple(pixels.shape), pixels.data_ptr())
        if "unknown_pos" in self.inputs:
            unknown = self._device_zeros(pixels.shape[0], pixels.device)
            binding.bind_input("unknown_pos", "cuda", index, np.bool_, tuple(unknown.shape), unknown.data_ptr())
        for name in ("logits", "pooled"):
            binding.bind_output(name, "cuda", index)
        self.session.run_with_iobinding(binding)
        return binding


def load_uint8(split: str | Path | Manifest, limit: int | None, batch_size: int,
               transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` images (uint8, un-normalized) and labels of a split (a directory, an http(s) URL or a
    loaded manifest), in manifest order; ``transform``: per image, e.g. :meth:`OnnxModel.resize_crop` (images of
    varying sizes -> the model's input size)."""
    dataset = ShardDataset(split, transform=transform, epoch_length=limit)
    xs, ys = [], []
    for x, y in make_loader(dataset, batch_size):
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def accuracy(model: OnnxModel, images: torch.Tensor, labels: torch.Tensor, batch_size: int,
             desc: str = "accuracy") -> dict[str, float]:
    top1 = top5 = 0
    for x, y in tqdm(list(zip(images.split(batch_size), labels.split(batch_size), strict=True)), desc=desc,
                     leave=False):
        logits, _ = model.run(model.normalize(model.pad(x)))
        top = torch.from_numpy(logits).topk(min(5, logits.shape[1]), dim=1).indices
        top1 += int((top[:, 0] == y).sum())
        top5 += int((top == y[:, None]).any(1).sum())
    return {"top1": top1 / len(labels), "top5": top5 / len(labels), "count": len(labels)}


def consistency(model: OnnxModel, images: torch.Tensor, batch_size: int, ratios=CONSISTENCY_RATIOS,
                seed: int = 0) -> dict[str, dict[str, float]]:
    """MJP consistency and Diff. Norm (of the pooled feature the head reads) over jigsaw ratios gamma, by the one
    implementation the PyTorch evaluator uses (``patchplace.finetune.consistency_curve``); models with an
    ``unknown_pos`` input receive the shuffled positions. ``images``: uint8 as stored (padded and normalized here)."""
    clean = model.normalize(model.pad(images))
    return consistency_curve(model.run, clean, model.patch_size, ratios, mark_unknown="unknown_pos" in model.inputs,
                             batch_size=batch_size, seed=seed)


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


def time_runners(runners: dict[str, Callable[[torch.Tensor], Any]], shape: tuple[int, ...],
                 batch_sizes=(1, 8, 64), repeats: int = 20, *, warmup: int = 3, device: str = "cpu",
                 on_device: tuple[str, ...] = ()) -> dict[str, Any]:
    """p50 / p95 ms per batch and images/s of each runner on the same random (B, *shape) inputs, keyed
    ``name/batchB``; per batch size the runners take turns, each ``warmup`` untimed and ``repeats`` timed calls.
    ``device`` "cuda": every call is timed CUDA-synchronised (the device is synchronised before the clock starts and
    before it stops), and the runners named in ``on_device`` get the inputs already on the GPU (the others: on the
    host, as they are served)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: dict[str, Any] = {}
    for bs in batch_sizes:
        x = torch.randn(bs, *shape)
        x_device = x.to(device) if on_device else x
        for name, run in runners.items():
            inputs = x_device if name in on_device else x
            with torch.inference_mode():
                for _ in range(warmup):
                    run(inputs)
                sync()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    run(inputs)
                    sync()
                    times.append(time.perf_counter() - start)
            times.sort()
            p50, p95 = times[len(times) // 2], times[min(len(times) - 1, int(0.95 * len(times)))]
            out[f"{name}/batch{bs}"] = {"p50_ms": round(p50 * 1e3, 3), "p95_ms": round(p95 * 1e3, 3),
                                        "images_per_s": round(bs / p50, 1)}
    return out


def pytorch_model(checkpoint: str | Path, device: str = "cpu") -> Classifier:
    """The checkpoint's classifier (logits, pooled) in eval mode on ``device``: the PyTorch side of parity and
    latency."""
    from patchplace.models import load_pretrained

    return Classifier(load_pretrained(checkpoint)[0].eval()).to(device)


def latency(model: OnnxModel, batch_sizes=(1, 8, 64), repeats: int = 20, checkpoint: str | None = None,
            warmup: int = 3) -> dict[str, Any]:
    """p50 / p95 ms per batch and images/s for ONNX Runtime (host inputs and outputs, as served), and PyTorch eager
    on the same inputs on the provider's device; on a GPU also ONNX Runtime with its input and outputs bound on the
    GPU (``onnxruntime_iobinding``, like for like with PyTorch there)."""
    runners: dict[str, Callable[[torch.Tensor], Any]] = {"onnxruntime": model.run}
    on_device: tuple[str, ...] = ()
    if model.device == "cuda":
        runners["onnxruntime_iobinding"] = model.run_on_device
        on_device = ("onnxruntime_iobinding", "pytorch")
    if checkpoint:
        runners["pytorch"] = pytorch_model(checkpoint, model.device)
    return time_runners(runners, (model.channels, model.height, model.width), batch_sizes, repeats, warmup=warmup,
                        device=model.device, on_device=on_device)


def parity(model: OnnxModel, images: torch.Tensor, labels: torch.Tensor, checkpoint: str | Path,
           batch_size: int) -> dict[str, Any]:
    """ONNX Runtime against PyTorch eager on the same device as the session's provider, on the same normalized
    inputs: max / mean abs logit difference, argmax agreement, and each one's top-1."""
    torch_model = pytorch_model(checkpoint, model.device)
    worst = total = 0.0
    agree = ort_right = torch_right = elements = 0
    for x, y in tqdm(list(zip(images.split(batch_size), labels.split(batch_size), strict=True)), desc="parity",
                     leave=False):
        pixels = model.normalize(model.pad(x))
        ort_logits = torch.from_numpy(model.run(pixels)[0])
        with torch.inference_mode():
            torch_logits = torch_model(pixels.to(model.device))[0].float().cpu()
        diff = (ort_logits - torch_logits).abs()
        worst, total, elements = max(worst, float(diff.max())), total + float(diff.sum()), elements + diff.numel()
        agree += int((ort_logits.argmax(1) == torch_logits.argmax(1)).sum())
        ort_right += int((ort_logits.argmax(1) == y).sum())
        torch_right += int((torch_logits.argmax(1) == y).sum())
    n = len(labels)
    return {"count": n, "device": model.device, "max_abs_logit_diff": worst,
            "mean_abs_logit_diff": total / max(1, elements),
            "argmax_agreement": agree / max(1, n), "onnxruntime_top1": ort_right / max(1, n),
            "pytorch_top1": torch_right / max(1, n)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(model: OnnxModel) -> dict[str, Any]:
    """What the numbers were measured on: the hardware line, ONNX Runtime's build and version, torch's, the
    provider's options and the fp32 math settings of both sides (TF32 changes parity on a GPU)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    env: dict[str, Any] = {
        "hardware": f"{cpu_name()}, {os.cpu_count()} cores, {gpu}", "gpu": gpu, "onnxruntime": ort.__version__,
        "onnxruntime_build": ort_package(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "provider": model.session.get_providers()[0], "device": model.device,
        "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    with warnings.catch_warnings():  # the allow_tf32 flags are being replaced by fp32_precision (torch >= 2.9)
        warnings.simplefilter("ignore")
        env["torch_cudnn_allow_tf32"] = bool(torch.backends.cudnn.allow_tf32)
    options = model.session.get_provider_options().get(env["provider"], {})
    env["provider_options"] = {k: v for k, v in options.items() if k in (
        "use_tf32", "cudnn_conv_algo_search", "device_id", "arena_extend_strategy", "do_copy_in_default_stream",
        "cudnn_conv_use_max_workspace", "prefer_nhwc", "enable_cuda_graph")}
    return env


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if curve := results.get("consistency"):  # (--consistency-limit 0: none)
        gammas = [float(g) for g in curve]
        fig, axes = plt.subplots(1, 2, figsize=(8, 3))
        axes[0].plot(gammas, [v["consistency"] for v in curve.values()], marker="o")
        axes[0].set(xlabel="eval jigsaw ratio gamma", ylabel="consistency", title="prediction consistency")
        axes[1].plot(gammas, [v["diff_norm"] for v in curve.values()], marker="o")
        axes[1].set(xlabel="eval jigsaw ratio gamma", ylabel="Diff. Norm", title="feature change")
        fig.tight_layout()
        fig.savefig(out / "consistency.png", dpi=120)
        plt.close(fig)
    if results.get("robustness", {}).get("errors"):
        errors = results["robustness"]["errors"]
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.bar(range(len(errors)), [e["error"] for e in errors.values()])
        ax.set_xticks(range(len(errors)), list(errors), rotation=60, ha="right", fontsize=7)
        ax.set(ylabel="error (mean over 5 severities)", title="corruption robustness")
        fig.tight_layout()
        fig.savefig(out / "robustness.png", dpi=120)
        plt.close(fig)


def to_markdown(results: dict[str, Any]) -> str:
    a = results["accuracy"]
    lines = [f"# ONNX Runtime evaluation of {results['model']}", "", f"providers: {results['providers']}", ""]
    if env := results.get("environment"):
        options = ", ".join(f"{k}={v}" for k, v in env.get("provider_options", {}).items())
        lines += [f"hardware: {env['hardware']}; {env['onnxruntime_build']}, torch {env['torch']}"
                  + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else "")
                  + f"; provider {env['provider']}" + (f" ({options})" if options else ""), ""]
    lines += [f"- top-1 {a['top1']:.4f}, top-5 {a['top5']:.4f} on {a['count']} images", ""]
    if par := results.get("parity"):
        lines += [f"Parity with PyTorch eager on the same device ({par['device']}, {par['count']} images of "
                  f"{results['data']}):", "",
                  "| max abs logit diff | mean abs logit diff | argmax agreement | top-1 ONNX Runtime | "
                  "top-1 PyTorch |",
                  "| --- | --- | --- | --- | --- |",
                  f"| {par['max_abs_logit_diff']:.2e} | {par['mean_abs_logit_diff']:.2e} | "
                  f"{par['argmax_agreement']:.4f} | {par['onnxruntime_top1']:.4f} | {par['pytorch_top1']:.4f} |", ""]
    if "consistency" in results:
        lines += ["| eval gamma | consistency | Diff. Norm |", "| --- | --- | --- |"]
        lines += [f"| {g} | {v['consistency']:.4f} | {v['diff_norm']:.4f} |" for g, v in results["consistency"].items()]
    for part, why in results.get("skipped", {}).items():
        lines += ["", f"Skipped: {part} ({why})."]
    if "robustness" in results:
        r = results["robustness"]
        lines += ["", f"Corruptions ran: {', '.join(r['ran'])}; failed here: {', '.join(r['failed']) or 'none'}.",
                  f"Mean corruption error: {r['mean_error']:.4f}" + (f"; mCE {r['mce']:.4f}" if r.get("mce") else "")
                  + (f"; no mCE (no reference error or no run for {', '.join(r['mce_missing'])}; mean CE over the "
                     f"rest {r['mce_partial']:.4f})" if r.get("mce_partial") is not None else "")]
    if "latency" in results:
        lat = results["latency"]
        timing = " (CUDA-synchronised)" if (results.get("environment") or {}).get("device") == "cuda" else ""
        lines += ["", f"Latency{timing}; speed-up: PyTorch eager's p50 / this runtime's p50 at the same batch.", "",
                  "| runtime / batch | p50 ms | p95 ms | images/s | speed-up vs PyTorch |",
                  "| --- | --- | --- | --- | --- |"]
        for k, v in lat.items():
            reference = lat.get(f"pytorch/{k.split('/')[-1]}")
            speedup = f"{reference['p50_ms'] / v['p50_ms']:.2f}x" if reference and v["p50_ms"] else "-"
            lines.append(f"| {k} | {v['p50_ms']} | {v['p95_ms']} | {v['images_per_s']} | {speedup} |")
    return "\n".join(lines) + "\n"


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement the command line asks for; raises :class:`ExportError` / :class:`DataError` (nothing is
    written then), except for a part that cannot run here (:class:`Unavailable`), which is skipped: its reason is in
    ``results["skipped"]``, and the rest is kept."""
    model = OnnxModel(args.model, provider=args.provider)
    manifest = Manifest.load(args.data)
    model.check_data(manifest)
    images, labels = load_uint8(manifest, args.limit, args.batch_size,
                                transform=model.resize_crop if model.resizes else None)
    results: dict[str, Any] = {"model": str(args.model), "data": str(args.data),
                               "providers": model.session.get_providers(), "environment": environment(model)}
    results["accuracy"] = accuracy(model, images, labels, args.batch_size)
    skipped: dict[str, str] = {}

    def optional(part: str, measure: Callable[[], Any]) -> None:
        """``results[part] = measure()``, or — where the part cannot run here (:class:`Unavailable`: a missing
        extra, images it cannot take) — the part skipped, said in one line, and what was measured kept."""
        try:
            results[part] = measure()
        except Unavailable as exc:
            skipped[part] = str(exc)
            print(f"[ort-eval] {part} skipped: {exc}", file=sys.stderr, flush=True)

    if args.checkpoint and args.parity_limit != 0:
        n = len(images) if args.parity_limit is None else min(args.parity_limit, len(images))
        optional("parity", lambda: parity(model, images[:n], labels[:n], args.checkpoint, args.batch_size))
    if args.consistency_limit:  # 0: skipped
        n = min(args.consistency_limit, len(images))
        optional("consistency", lambda: consistency(model, images[:n], args.batch_size))
    if args.robustness_limit:
        reference = json.loads(Path(args.reference_errors).read_text()) if args.reference_errors else None
        n = min(args.robustness_limit, len(images))
        optional("robustness", lambda: robustness(model, images[:n], labels[:n], args.batch_size,
                                                  reference=reference, cache=args.corruption_cache))
    if args.latency_repeats:
        optional("latency", lambda: latency(model, tuple(args.latency_batches), args.latency_repeats,
                                            args.checkpoint, warmup=args.latency_warmup))
    if skipped:
        results["skipped"] = skipped
    return results


OUTPUTS = ("results.json", "results.md", "consistency.png", "robustness.png")  # what --out receives


def check_outputs(args: argparse.Namespace, argv: list[str]) -> None:
    """Before any work: refuse an int8 / fp16 copy as the model (with the command that evaluates its exported
    pair), and an ``--out`` or ``--corruption-cache`` that cannot be written (a file where a directory goes, a
    directory where a result file goes, a read-only place), each in one line."""
    if suffix := copy_suffix(args.model):
        kind, flag = ("int8", "--quantize") if suffix == INT8_SUFFIX else ("fp16", "--fp16")
        fp32 = str(fp32_of(args.model))
        command = shlex.join(["python", "-m", "patchplace.export.evaluate",
                              *(fp32 if a == args.model else a for a in argv)])
        raise ExportError(f"{args.model} is the {kind} copy {flag} wrote of {fp32}, not an exported pair (no "
                          f"sidecar of its own): evaluate the pair ({command}); the export's {flag} --data "
                          f"SPLIT reports the {kind} model's top-1 change")
    out = Path(args.out)
    check_writable(out, f"--out {out}")
    for name in OUTPUTS:
        if (out / name).is_dir():
            raise ExportError(f"--out {out}: {out / name} is a directory where a result file goes: remove it, or "
                              "choose another --out")
    if args.corruption_cache is not None and args.robustness_limit:
        check_writable(Path(args.corruption_cache), f"--corruption-cache {args.corruption_cache}")


def main(argv: list[str] | None = None) -> int:
    parser = evaluate_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        if min(args.consistency_limit, args.robustness_limit) < 0:
            raise ExportError("--consistency-limit and --robustness-limit count images: give 0 (skip) or more")
        check_outputs(args, argv)
        results = evaluate(args)
    except (ExportError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path this file system cannot hold (--out, --data, --corruption-cache)
        if exc.errno != errno.ENAMETOOLONG:
            raise
        print(f"error: {exc.filename}: a name in this path is longer than the file system takes (ENAMETOOLONG): "
              "choose a shorter path", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(to_markdown(results))
    plot(results, out)
    print(to_markdown(results))
    if missing := [part for part in args.require or () if part in results.get("skipped", {})]:
        print(f"error: {', '.join(missing)} required (--require) but skipped: {results['skipped'][missing[0]]} "
              f"(the other results are in {out / 'results.json'})", file=sys.stderr)
        return 2
    return 0

