"""fsdp_memory: what ``run.fsdp`` and ``run.activation_checkpointing`` save per rank, measured where torch shards on
CPUs: two processes over gloo, each running one training step (forward, backward, AdamW) of its half of the batch,
as DDP (every rank the whole model, Accelerate's path on CPUs), with every Transformer block recomputing its
activations (Chen et al. 2016, arXiv:1604.06174), with FSDP2's ``fully_shard`` (ZeRO-3: Rajbhandari et al. 2020,
ZeRO: Memory Optimizations Toward Training Trillion Parameter Models, arXiv:1910.02054) as run.fsdp=full_shard
builds it (each Transformer block a unit, as the knob's wrap policy), and with both; at ViT-B
and ViT-L widths with a shrunk depth.

Memory is the process's resident set (``/proc/self/status``): its peak during the measured step (``VmHWM``, reset
through ``/proc/self/clear_refs`` after a warm-up step that made AdamW's state) above the resident set before the
model was built, so weights, gradients, AdamW's moments, activations, DDP's buckets and FSDP's gathered blocks all
count. Large allocations are mapped (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the resident set."""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patchplace.models.backbone import CheckpointedBlock

MIB = 2**20
MODES = {"ddp": (False, False), "ddp + ckpt": (True, False), "fsdp": (False, True), "fsdp + ckpt": (True, True)}
WORLD = 2


def shard(objective: nn.Module, rank: int, mode: str = "full_shard") -> nn.Module:
    """``objective`` sharded in place with torch's ``fully_shard`` as ``accelerator.prepare`` shards it under
    ``run.fsdp=mode`` (Accelerate's ``fsdp2_prepare_model`` with the knob's transformer-based wrap policy): each
    Transformer block (every :class:`CheckpointedBlock`: the units ``block_classes`` names) a unit of its own, then
    the root holding the rest (a process group must be running; ``rank`` is unused: every rank shards alike)."""
    from torch.distributed.fsdp import fully_shard

    reshard = {"full_shard": True, "shard_grad_op": False}[mode]
    for module in [m for m in objective.modules() if isinstance(m, CheckpointedBlock)]:
        fully_shard(module, reshard_after_forward=reshard)
    return fully_shard(objective, reshard_after_forward=reshard)


def _status(key: str) -> float:
    """``key`` (VmRSS, VmHWM) of /proc/self/status, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (a shard's local part)."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if torch.is_tensor(t))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor) -> None:
    torch.manual_seed(0)
    model((images, labels), progress=0.5)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(name: str, width: str, depth: int, batch: int, mode: str, rank: int) -> dict[str, Any]:
    """One mode's row on this rank: the step's peak resident set above the start (``peak_mib``), what persists
    between steps (weights + AdamW's moments on this rank: ``state_mib``) and the measured step's seconds."""
    from torch.nn.parallel import DistributedDataParallel

    from patchplace.models.backbone import set_grad_checkpointing
    from patchplace.research.benchmarks.activation_memory import build

    checkpointing, sharded = MODES[mode]
    gc.collect()
    start = _status("VmRSS")
    objective = build(name, width, depth)
    set_grad_checkpointing(objective, checkpointing)
    model = shard(objective, rank) if sharded else DistributedDataParallel(
        objective, find_unused_parameters=bool(getattr(objective, "leaves_parameters_unused", False)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    c = objective.backbone.config
    g = torch.Generator().manual_seed(rank)
    images = torch.randn(batch, c.in_chans, c.img_size, c.img_size, generator=g)
    labels = torch.randint(0, max(c.num_classes, 1), (batch,), generator=g)
    _step(model, optimizer, images, labels)  # AdamW's moments exist from here on
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    began = time.perf_counter()
    _step(model, optimizer, images, labels)
    seconds = time.perf_counter() - began
    peak = _status("VmHWM") - start
    moments = [t for s in optimizer.state.values() for t in s.values()]
    state = _local_bytes([*model.parameters(), *model.buffers(), *moments]) / MIB
    del model, objective, optimizer
    return {"peak_mib": round(peak, 1), "state_mib": round(state, 1), "step_s": round(seconds, 2)}


def _worker(rank: int, port: int, out: str, name: str, width: str, depth: int, batch: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        rows = {mode: measure(name, width, depth, batch, mode, rank) for mode in MODES}
        every: list[Any] = [None] * WORLD
        dist.all_gather_object(every, rows)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(every))


def free_port() -> int:
    """A free local TCP port for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair_rows(name: str, width: str, depth: int, batch: int) -> list[dict[str, Any]]:
    """Every mode of ``name`` at ``width``, on a fresh pair of processes: a row per mode, the larger rank's peak."""
    import torch.multiprocessing as mp

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)  # (read by each child's allocator at its start)
    with tempfile.TemporaryDirectory(prefix="fsdp_memory_") as tmp:
        out = Path(tmp) / "rows.json"
        mp.spawn(_worker, args=(free_port(), str(out), name, width, depth, batch), nprocs=WORLD, join=True)
        ranks = json.loads(out.read_text())
    rows, ddp = [], max(r["ddp"]["peak_mib"] for r in ranks)
    for mode in MODES:
        peak = max(r[mode]["peak_mib"] for r in ranks)
        rows.append({"name": f"fsdp_memory/{width} {name} {mode}", "width": width, "method": name, "mode": mode,
                     "depth": depth, "batch_per_rank": batch, "processes": WORLD, "peak_mib": peak,
                     "vs_ddp": round(peak / ddp, 3), "state_mib": max(r[mode]["state_mib"] for r in ranks),
                     "step_s": max(r[mode]["step_s"] for r in ranks)})
    return rows


def fsdp_memory_rows(methods: tuple[str, ...], widths: tuple[str, ...], depth: int,
                     batch: int) -> list[dict[str, Any]]:
    rows = []
    for width in widths:
        for name in methods:
            for row in pair_rows(name, width, depth, batch):
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def fsdp_memory_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """--suite fsdp_memory: --methods (default supervised mae ijepa) at --memory-widths, --memory-depth blocks,
    --memory-batch images of 224 px per rank, fp32, 2 CPU processes."""
    methods = tuple(args.methods or ("supervised", "mae", "ijepa"))
    rows = fsdp_memory_rows(methods, tuple(args.memory_widths), depth=args.memory_depth, batch=args.memory_batch)
    return [{**row, "suite": "fsdp_memory"} for row in rows]
