"""What this machine's processor offers a training step, and the precision ``run.mixed_precision=auto`` trains in.

On a CPU, bf16 autocast pays only where the CPU has bf16 units: without them (AVX2, AVX-512 without ``avx512_bf16``)
every bf16 matmul runs through a scalar fallback, measured ~15x slower than float32 for the study ViT's training
step (docs/benchmarks.md, the CPU speed ladder). ``auto`` detects, never assumes:

* CUDA: bf16 where the GPU supports it, else float32.
* CPU with AMX bf16 tiles (``amx_bf16``): bf16 autocast. Its training was tested equivalent to float32 on the
  validation split (:data:`CPU_BF16_EQUIVALENT`, ``benchmark.py --suite cpu_equivalence``).
* CPU with ``avx512_bf16`` but no AMX: float32. The one measurement of the study ViT's step on such a CPU read bf16
  at 0.74x (batch 32) and 0.94x (batch 64) of float32: at width 128 the casts cost more than the units give.
* Any other CPU: float32.

``run.mixed_precision=no`` or ``bf16`` forces either; the choice and its reason are printed once, recorded in the
run's metadata (``compute``) and in the study report.

``fp16`` is a GPU precision: Accelerate autocasts fp16 (with its loss scaler) on accelerators only and on a CPU
leaves the step in float32 (``Accelerator``: ``native_amp`` stays off for ``fp16`` on ``cpu``; measured: the losses
and weights of fp16 and ``no`` runs are bit-identical on a CPU). A run asked for fp16 on a CPU therefore trains,
and is recorded (``compute.value``), as ``no``, with a printed line saying so: the shipped GPU recipes (fp16 for
MAE / MP3 / DeiT / DropPos) still run unchanged on a CPU, without the record claiming a precision that never ran.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

# The CPU flags that decide bf16 speed, by what they provide (Linux /proc/cpuinfo names).
BF16_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "avx_vnni", "fma")
CPUINFO = Path("/proc/cpuinfo")

# The equivalence test's verdict (seed-paired TOST at alpha 0.05, margin +-1 pt, MP3 and DropPos at the study's
# budget: 1% linear probe and fine-tuned top-1 on the validation split; docs/benchmarks.md): bf16 training is adopted
# by ``auto`` only where this is True.
CPU_BF16_EQUIVALENT = False


@dataclass(frozen=True)
class CpuInfo:
    """The processor: its name, the bf16-relevant flags it has, its bf16 units (``amx``, ``avx512_bf16`` or
    None) and whether torch's oneDNN runs bf16 matmuls natively on it."""

    name: str
    flags: tuple[str, ...]
    bf16_units: str | None
    onednn_bf16: bool

    def line(self) -> str:
        units = {"amx": "AMX bf16 tiles", "avx512_bf16": "AVX-512 bf16"}.get(self.bf16_units or "", "no bf16 units")
        return f"{self.name} ({', '.join(self.flags) or 'no AVX'}; {units})"


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo's first processor; the platform's name and no flags elsewhere."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields.get("model name", platform.machine()), set(fields.get("flags", "").split())


@cache
def cpu_info() -> CpuInfo:
    name, flags = _cpuinfo()
    units = "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else None
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn = False
    return CpuInfo(name, tuple(f for f in BF16_FLAGS if f in flags), units, onednn)


@dataclass(frozen=True)
class Precision:
    """The precision a run trains in: what was asked, what it resolved to, and why (one line)."""

    asked: str
    value: str
    why: str
    device: str

    def record(self) -> dict[str, Any]:
        """What the run's metadata records: this, the CPU, and any dispatch mode the run trains under (e.g. the
        equivalence test's emulated bf16 matmuls)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        modes = [type(m).__name__ for m in _get_current_dispatch_mode_stack()]
        return {**asdict(self), **({"cpu": asdict(cpu_info())} if self.device == "cpu" else {}),
                **({"dispatch_modes": modes} if modes else {})}


def resolve_precision(asked: str, device: str | None = None) -> Precision:
    """``run.mixed_precision`` as it will train on ``device`` (default: cuda when available, else cpu): ``auto``
    resolved by the rules of this module, fp16 on a CPU as ``no`` (what Accelerate trains), anything else as asked."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if asked == "fp16" and device == "cpu":
        return Precision(asked, "no", "Accelerate autocasts fp16 on GPUs only, so on this CPU the run trains in "
                         "float32 (the numbers of run.mixed_precision=no, recorded as compute.value=no); "
                         "run.mixed_precision=bf16 autocasts on a CPU", device)
    if asked != "auto":
        return Precision(asked, asked, "as asked", device)
    if device == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        return Precision(asked, "bf16" if bf16 else "no",
                         f"{torch.cuda.get_device_name()}: {'bf16 supported' if bf16 else 'no bf16'}", device)
    cpu = cpu_info()
    if cpu.bf16_units == "amx" and cpu.onednn_bf16 and CPU_BF16_EQUIVALENT:
        return Precision(asked, "bf16", f"{cpu.line()}: bf16 autocast (tested equivalent to float32)", device)
    if cpu.bf16_units == "amx" and cpu.onednn_bf16:
        why = "bf16 training has not passed its equivalence test"
    elif cpu.bf16_units == "avx512_bf16":
        why = "AVX-512 bf16 without AMX trains the study ViT slower than float32"
    else:
        why = "bf16 matmuls would run ~15x slower than float32 here"
    return Precision(asked, "no", f"{cpu.line()}: float32 ({why})", device)


def precision_line(precision: Precision) -> str:
    """The one line a run prints about its precision where it is not the one asked for (``auto``; fp16 on a CPU)."""
    if precision.asked != "auto":
        return f"run.mixed_precision={precision.asked}: {precision.why}"
    force = "run.mixed_precision=bf16" if precision.value == "no" else "run.mixed_precision=no"
    return f"run.mixed_precision=auto: {precision.why}; force the other with {force}"
