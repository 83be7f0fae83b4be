"""activation_memory: what ``run.activation_checkpointing`` saves, per method, on any machine — the bytes of the
tensors a training step holds for its backward and the step's peak of live tensor bytes, with and without every
Transformer block recomputing its activations in the backward (Chen et al. 2016, Training Deep Nets with Sublinear
Memory Cost, arXiv:1604.06174), at ViT-B and ViT-L widths with a shrunk depth.

The bytes are counted on the step itself (:class:`LiveBytes`: every storage an op creates, until it is freed), not
with ``saved_tensors_hooks`` alone: a non-reentrant checkpoint keeps its block's inputs through its recomputation
closure, which no outer hook sees, and its recomputed activations live during the backward only."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from patchplace.models import create_model
from patchplace.models.backbone import CheckpointedBlock, set_grad_checkpointing
from patchplace.objectives import list_methods

# ViT-B / ViT-L (Dosovitskiy et al. 2021, Table 1) widths on the vit_base preset (patch 16, 224 px)
WIDTHS = {"vit_b": {"embed_dim": 768, "num_heads": 12}, "vit_l": {"embed_dim": 1024, "num_heads": 16}}
MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storages the ops run under it create (parameters and inputs made before it are not
    counted): ``live`` now, ``peak`` since the start or :meth:`reset_peak`. A storage counts from the op that
    creates it until it is freed (its Python object is preserved while any tensor holds it, so its finalizer runs at
    the free); an op's output is an allocation unless its storage is one of the op's inputs' (a view, an in-place
    result)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._tracked: set[int] = set()

    def reset_peak(self) -> None:
        self.peak = self.live

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key, size = id(storage), storage.nbytes()
        if key in self._tracked or key in inputs or size == 0:  # a view or an in-place result: no allocation
            return
        self._tracked.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._tracked.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, inputs)
        return out


def _autocast(device: torch.device, amp: str):
    return (torch.autocast(device.type, dtype=torch.bfloat16) if amp == "bf16" else contextlib.nullcontext())


def step_bytes(objective: nn.Module, batch: int, *, amp: str = "no", seed: int = 0) -> dict[str, float]:
    """One training step (forward + backward) of ``objective`` on ``batch`` random images: ``held_mib``, the
    tensors alive between forward and backward (what the backward needs, the loss included), ``peak_mib``, the most
    live tensor bytes at any point of the step (the parameter gradients included: ``grads_mib``), and ``step_s``,
    its wall time."""
    c = objective.backbone.config
    device = next(objective.parameters()).device
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, c.in_chans, c.img_size, c.img_size, generator=g).to(device)
    labels = torch.randint(0, max(c.num_classes, 1), (batch,), generator=g).to(device)
    objective.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with LiveBytes() as counter:
        with _autocast(device, amp):
            loss = objective((images, labels), progress=0.5)["loss"]
        held = counter.live
        loss.backward()
        del loss
    seconds = time.perf_counter() - start
    grads = sum(p.grad.nbytes for p in objective.parameters() if p.grad is not None)
    objective.zero_grad(set_to_none=True)
    return {"held_mib": round(held / MIB, 1), "peak_mib": round(counter.peak / MIB, 1),
            "grads_mib": round(grads / MIB, 1), "step_s": round(seconds, 2)}


def trained_blocks(objective: nn.Module) -> int:
    """The Transformer blocks of ``objective`` that train, the ones that recompute (a frozen one, as I-JEPA's EMA
    target encoder's, runs without autograd)."""
    return sum(any(p.requires_grad for p in m.parameters()) for m in objective.modules()
               if isinstance(m, CheckpointedBlock))


def build(name: str, width: str, depth: int) -> nn.Module:
    """Method ``name`` (its registration's PE mode and head, its paper's decoder / predictor widths and defaults)
    on a ViT of ``width`` (:data:`WIDTHS`) and ``depth`` blocks, patch 16 at 224 px, 3 channels."""
    spec = next(s for s in list_methods("image") if s.name == name)
    torch.manual_seed(0)
    backbone = create_model("vit_base", in_chans=3, depth=depth, pos_embed=spec.pos_embed,
                            num_classes=1000 if spec.needs_head else 0, **WIDTHS[width])
    return spec.objective_cls(backbone, spec.config_cls.paper(**spec.defaults)).train()


def activation_memory_rows(methods: tuple[str, ...], widths: tuple[str, ...] = ("vit_b", "vit_l"), *,
                           depth: int = 4, batch: int = 8, amp: str = "no") -> list[dict[str, Any]]:
    """Per method and width: :func:`step_bytes` without and with activation checkpointing, and their ratios."""
    rows = []
    for width in widths:
        for name in methods:
            objective = build(name, width, depth)
            set_grad_checkpointing(objective, False)
            blocks = trained_blocks(objective)
            plain = step_bytes(objective, batch, amp=amp)
            set_grad_checkpointing(objective, True)
            ckpt = step_bytes(objective, batch, amp=amp)
            row = {"name": f"activation_memory/{width} {name}", "width": width, "method": name, "depth": depth,
                   "batch": batch, "blocks": blocks, "amp": amp, "held_mib": plain["held_mib"],
                   "held_ckpt_mib": ckpt["held_mib"],
                   "held_ratio": round(ckpt["held_mib"] / plain["held_mib"], 3), "peak_mib": plain["peak_mib"],
                   "peak_ckpt_mib": ckpt["peak_mib"], "peak_ratio": round(ckpt["peak_mib"] / plain["peak_mib"], 3),
                   "grads_mib": plain["grads_mib"],
                   "step_s": plain["step_s"], "step_ckpt_s": ckpt["step_s"],
                   "time_ratio": round(ckpt["step_s"] / plain["step_s"], 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del objective
    return rows


def activation_memory_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """--suite activation_memory: every image method (--methods to choose) at ViT-B and ViT-L widths, depth
    --memory-depth, batch --memory-batch, 224 px, fp32 unless --amp bf16."""
    methods = tuple(args.methods or [s.name for s in list_methods("image")])
    rows = activation_memory_rows(methods, tuple(args.memory_widths), depth=args.memory_depth,
                                  batch=args.memory_batch, amp=args.amp or "no")
    return [{**row, "suite": "activation_memory"} for row in rows]
