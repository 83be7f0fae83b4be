"""What a training step asks of the host: ATen ops dispatched, host synchronisations, host-to-device copies.

A GPU step is fast when the host only enqueues work: no op may read a device value on the host (``.item()``,
``nonzero``, boolean indexing: the host waits for the device), no host-built tensor may be copied in the middle of
the step (a blocking copy from pageable memory), and every launch should be one the step needs. :func:`count_step`
counts these for any callable, on any device, by a ``TorchDispatchMode`` that sees every ATen op the call
dispatches (forward and autograd's backward alike). On a CPU the copies are invisible (host and device are one);
:func:`fake_cuda` runs the same step on a fake CUDA device (``FakeTensorMode``: shapes and devices, no data), where
a copy from the host shows as one and an op that needs a device value raises, as it would stall a real GPU.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops whose result the host must wait for: a device value read on the host, or an output whose shape depends on
# device values (the host learns the shape before it can allocate).
SYNC_OPS = {
    aten._local_scalar_dense.default: "item",  # .item(), float(t), int(t), bool(t), .tolist()
    aten.nonzero.default: "nonzero",
    aten.nonzero_static.default: None,  # static size: no sync
    aten.masked_select.default: "masked_select",
    aten.unique_consecutive.default: "unique",
    aten._unique2.default: "unique",
    aten.is_nonzero.default: "is_nonzero",
    aten.equal.default: "equal",
}
_COPIES = (aten._to_copy.default, aten.copy_.default)


@dataclass
class StepCounts:
    """Per call: ``ops`` ATen ops dispatched; ``syncs`` the host synchronisations by kind; ``host_copies`` the
    host-to-device copies by op (only seen where the step's device is not the CPU)."""

    ops: int = 0
    syncs: Counter = field(default_factory=Counter)
    host_copies: Counter = field(default_factory=Counter)

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def num_host_copies(self) -> int:
        return sum(self.host_copies.values())


def _is_bool_index(func: Any, args: tuple) -> bool:
    """``x[mask]`` / ``x[mask] = v``: an index op with a boolean index (it runs ``nonzero`` inside)."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _devices(tree: Any) -> set[str]:
    leaves, _ = tree_flatten(tree)
    return {t.device.type for t in leaves if isinstance(t, torch.Tensor)}


class _Counting(TorchDispatchMode):
    def __init__(self, counts: StepCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counts = self.counts
        counts.ops += 1
        kind = SYNC_OPS.get(func)
        if kind is not None:
            counts.syncs[kind] += 1
        elif _is_bool_index(func, args):
            counts.syncs["boolean index"] += 1
        out = func(*args, **kwargs)
        if func in _COPIES:
            source = args[1] if func is aten.copy_.default else args[0]
            if isinstance(source, torch.Tensor) and source.device.type == "cpu" and _devices(out) - {"cpu"}:
                counts.host_copies[f"{func.__name__} {tuple(source.shape)}"] += 1
        return out


@contextlib.contextmanager
def counting() -> Iterator[StepCounts]:
    """``with counting() as counts: ...``: the ops, syncs and host copies of the block."""
    counts = StepCounts()
    with _Counting(counts):
        yield counts


def count_step(fn: Callable[[], Any]) -> StepCounts:
    """The :class:`StepCounts` of one call of ``fn``."""
    with counting() as counts:
        fn()
    return counts


@contextlib.contextmanager
def fake_cuda(*modules: torch.nn.Module) -> Iterator[Any]:
    """A ``FakeTensorMode`` in which ``device="cuda"`` works without a GPU, with ``modules`` (built on the CPU) moved
    to the fake CUDA device; make the batch inside it (``device="cuda"``), then run the step under :func:`counting`.
    An op that needs a device value raises (``DataDependentOutputException``, ``DynamicOutputShapeException``): on
    a GPU each is a host synchronisation. A CPU tensor the step meets outside its modules' parameters and buffers
    stays on the CPU, so using it on the device is a copy :func:`counting` reports, or a device-mismatch error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for module in modules:
            _to_fake_cuda(module, mode)
        yield mode


def _to_fake_cuda(module: torch.nn.Module, mode: Any) -> None:
    """Replaces every parameter and buffer of ``module`` by a fake CUDA tensor of its shape and dtype (the module
    is a fake one afterwards: build a fresh one to train)."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                fake = mode.from_tensor(param.detach()).to("cuda")
                sub._parameters[name] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = mode.from_tensor(buffer).to("cuda")
