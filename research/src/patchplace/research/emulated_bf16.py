"""bf16 training numerics at float32 speed, for testing bf16 training on a CPU without bf16 units.

Under ``run.mixed_precision=bf16`` autocast rounds the inputs of every matmul to bf16, and the
kernel returns a bf16 result accumulated in float32 (oneDNN's AVX-512 bf16 and AMX kernels
accumulate in float32). A CPU without bf16 units runs those matmuls through a scalar fallback,
~15x slower than float32 for the study ViT's step. This mode computes each bf16 matmul from the
same bf16-rounded inputs in float32 and rounds the result to bf16: the numerics of a bf16 unit
with float32 accumulation (up to summation order), at float32 speed. Every other operator
(attention, normalization, the optimizer) runs as it would, in the dtype autocast gives it.

    python -m patchplace.research.emulated_bf16 pretrain \\
        --config pipelines/configs/mp3_fashion_mnist.yaml run.mixed_precision=bf16

The first argument names the pipeline (pretrain or finetune); the rest are its arguments.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

PIPELINES = {"pretrain": "patchplace.pipelines.pretrain", "finetune": "patchplace.pipelines.finetune"}
USAGE = f"usage: python -m patchplace.research.emulated_bf16 {{{','.join(PIPELINES)}}} ARGS..."


def usage_answer(argv: list[str]) -> int | None:
    """What the command line answers without running a pipeline: the help (exit 0) or the usage (exit 2); None
    when ``argv`` names a pipeline to run."""
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return 0
    if not argv or argv[0] not in PIPELINES:
        print(f"{USAGE} (--help: what it does)", file=sys.stderr)
        return 2
    return None


if __name__ == "__main__" and (code := usage_answer(sys.argv[1:])) is not None:  # before torch loads below
    sys.exit(code)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

aten = torch.ops.aten
# the matmuls of a Transformer's training step (forward and backward: linear layers, their gradients)
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _up(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value


class EmulatedBF16Matmuls(TorchDispatchMode):
    """Within this mode (thread-local; autograd's backward included), a matmul with bf16 operands is computed in
    float32 from those operands and its result rounded to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            out = func(*map(_up, args), **{k: _up(v) for k, v in kwargs.items()})
            return out.to(torch.bfloat16)
        return func(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (code := usage_answer(argv)) is not None:
        if code == 0:
            raise SystemExit(0)  # as argparse's --help
        return code
    pipeline = importlib.import_module(PIPELINES[argv[0]])
    with EmulatedBF16Matmuls():
        return pipeline.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
