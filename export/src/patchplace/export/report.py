"""The evaluator's report: the environment the numbers were measured on, ``results.md`` and the PNG curves."""

from __future__ import annotations

import os
import platform
import warnings
from pathlib import Path
from typing import Any

import torch

from .ort_model import OnnxModel, ort_package
from .runtime import ort


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
