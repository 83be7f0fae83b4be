"""What the evaluator measures on clean images: accuracy, MJP consistency / Diff. Norm, parity with PyTorch eager
and latency (ONNX Runtime, PyTorch eager, and ONNX Runtime with its inputs and outputs bound on the GPU)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from patchplace.data import Manifest, ShardDataset, make_loader
from patchplace.finetune import consistency_curve

from .ort_model import OnnxModel
from .plan import Classifier

CONSISTENCY_RATIOS = (0.03, 0.09, 0.15, 0.27, 0.5)  # MJP Table 1 uses 0.15, Fig. 3 the curve


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
