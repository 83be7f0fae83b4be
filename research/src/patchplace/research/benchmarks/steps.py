"""What a pretraining step costs, measured (``pipelines/benchmark.py --suite objectives``, ``masks``, ``mp3_table2``,
``gpu``, ``saved_bytes``, ``profile``): the objectives built at the study's or the papers' widths, their forward +
backward + AdamW step time interleaved round-robin in one run (machine noise hits all alike) with each one's time
ratio to the supervised step beside its FLOP ratio (:mod:`.flops`: counted on the step), the training samples/s,
the achieved FLOP/s, and what one step asks of the host (ATen ops, host syncs: :func:`step_counts`); the mask
generators' time; activation bytes saved for backward.

Peak memory (:func:`step_memory`) is measured per objective in a **fresh process** (:func:`isolated_step_memory`):
a high-water mark never goes down, so in one process shared with other objectives it would only ever report the
largest of them, and freed memory the allocator keeps would hide what a later objective needs.
"""

from __future__ import annotations

import contextlib
import inspect
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from patchplace.models import create_model
from patchplace.objectives import MP3, MethodSpec, MJPConfig, MP3Config, ObjectiveError, Supervised, list_methods
from patchplace.objectives.block_masks import blockwise_masks, multiblock_masks
from patchplace.research.benchmarks.flops import step_flops, unwrap

# Decoder / predictor sizes. "study": the Fashion-MNIST configs of the study (pipelines/configs/*_fashion_mnist.yaml:
# decoders 128 x 2 x 4 heads, predictor 96 x 4 x 4 heads, MJP gamma 0.15). "paper": each config's ``paper()``
# widths, the papers' ImageNet settings (MAE decoder 512 x 8, DropPos 512 x 2, RandSAC 512 x 4, I-JEPA / StoP
# predictor 384 x 12), MJP gamma 0.03.
WIDTHS: dict[str, dict[str, Any]] = {
    "study": {"decoder": dict(decoder_dim=128, decoder_depth=2, decoder_heads=4),
              "predictor": dict(predictor_dim=96, predictor_depth=4, predictor_heads=4), "mjp_ratio": 0.15},
    "paper": {"decoder": None, "predictor": None, "mjp_ratio": MJPConfig().ratio},
}


# ---------------------------------------------------------------------------------------------- masks
def _median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def mask_times(grid: tuple[int, int], batch: int, *, repeats: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """Milliseconds per batch of the mask generators, each drawn for the whole batch with tensor ops of static
    shapes: I-JEPA multi-block and MJP block-wise at gamma 0.15 (BEiT's generator, its rounds in parallel)."""
    gen = torch.Generator().manual_seed(seed)
    shape = f"grid={grid[0]}x{grid[1]}/batch={batch}"
    generators = {"ijepa_multiblock": lambda: multiblock_masks(batch, grid, generator=gen),
                  "mjp_blockwise_0.15": lambda: blockwise_masks(batch, grid, 0.15, generator=gen)}
    return [{"name": f"masks/{name}/{shape}", "ms": round(_median_ms(make, repeats), 3), "batch": batch}
            for name, make in generators.items()]


# ---------------------------------------------------------------------------------------------- objectives
MP3_ETAS = (0.0, 0.5, 0.75)  # the MP3 masking ratios benchmarked by default


def default_objectives(preset: str = "vit_cpu", *, in_chans: int = 1, num_classes: int = 10,
                       img_size: int | None = None, widths: str = "study",
                       mp3_etas: tuple[float, ...] = MP3_ETAS, mae_ratios: tuple[float, ...] = (),
                       ) -> dict[str, Callable[[], nn.Module]]:
    """Builders of every registered image method on backbone ``preset`` (``img_size`` / ``in_chans`` override the
    preset's; the method's PE mode, a head when it trains through one), with decoder / predictor sizes ``widths``
    (see :data:`WIDTHS`), ``supervised`` first: MP3 as ``mp3_eta{eta}`` per ``mp3_etas``, ``mae`` (its config's
    ratio) plus ``mae_ratio{r}`` per ``mae_ratios`` (MP3 Table 2's MAE rows), MJP with the jigsaw on every step (the
    recipe shuffles half the batches after warm-up: the worst case), and ``stop_noema`` (StoP without its EMA
    update)."""
    if widths not in WIDTHS:
        raise ObjectiveError(f"widths must be one of {sorted(WIDTHS)}, got {widths!r}")
    w = WIDTHS[widths]
    size = {} if img_size is None else {"img_size": img_size}

    def build(spec: MethodSpec, **extra: Any) -> nn.Module:
        """``spec``'s objective at these widths (``paper()``, or the study's decoder / predictor sizes) + ``extra``."""
        backbone = create_model(preset, in_chans=in_chans, pos_embed=spec.pos_embed,
                                num_classes=num_classes if spec.needs_head else 0, **size)
        names = {f.name for f in fields(spec.config_cls)}
        extra = {**spec.defaults, **extra}
        if w["decoder"] is None:
            config = spec.config_cls.paper(**extra)
        else:
            sized = w["predictor"] if "predictor_dim" in names else w["decoder"] if "decoder_dim" in names else {}
            config = spec.config_cls(**{**sized, **extra}).validate()
        return spec.objective_cls(backbone, config)

    specs = {spec.name: spec for spec in list_methods("image")}
    variants: dict[str, dict[str, dict[str, Any]]] = {
        "mp3": {f"mp3_eta{eta:g}": {"eta": eta} for eta in mp3_etas},
        "mae": {"mae": {}, **{f"mae_ratio{r:g}": {"mask_ratio": r} for r in mae_ratios}},
        "mjp": {"mjp": {"ratio": w["mjp_ratio"], "apply_prob": 1.0, "warmup_fraction": 0.0}},
        "stop": {"stop": {}, "stop_noema": {}},
    }
    builders: dict[str, Callable[[], nn.Module]] = {}
    for name in sorted(specs, key=lambda n: n != "supervised"):
        for label, extra in variants.get(name, {name: {}}).items():
            builders[label] = lambda spec=specs[name], extra=extra: build(spec, **extra)
    return builders


def _input_shape(objective: nn.Module) -> tuple[int, int, int]:
    c = unwrap(objective).backbone.config
    return c.in_chans, c.img_size, c.img_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _takes_generator(obj: nn.Module) -> bool:
    return "generator" in inspect.signature(unwrap(obj).forward).parameters


AMP_DTYPES = {"no": None, "bf16": torch.bfloat16}


def _autocast(device: torch.device, amp: str):
    """``torch.autocast`` for ``amp`` ("bf16") on ``device``, or a no-op context for "no" (fp32)."""
    if amp not in AMP_DTYPES:
        raise ObjectiveError(f"amp must be one of {sorted(AMP_DTYPES)}, got {amp!r}")
    dtype = AMP_DTYPES[amp]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def train_step(name: str, obj: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple,
                generator: torch.Generator | None = None, amp: str = "no") -> None:
    kwargs = {"generator": generator} if generator is not None and _takes_generator(obj) else {}
    with _autocast(batch[0].device, amp):
        loss = obj(batch, progress=0.5, **kwargs)["loss"]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if hasattr(obj, "update_target") and not name.endswith("_noema"):  # EMA target encoder (I-JEPA)
        obj.update_target(0.5)


def step_counts(name: str, obj: nn.Module, batch: tuple, amp: str = "no") -> dict[str, Any]:
    """What one training step asks of the host (:func:`patchplace.objectives.audit.count_step`): ATen ops
    dispatched and host synchronisations (by kind) of its forward, backward and EMA update; the optimizer's step,
    the same for every objective, is left out. ``host_copies``: copies of host-built tensors to the device (seen
    only where the batch is not on the CPU). The RNG is forked and the gradients dropped."""
    from patchplace.objectives.audit import count_step

    obj = unwrap(obj)
    device = batch[0].device

    def step() -> None:
        with _autocast(device, amp):
            loss = obj(batch, progress=0.5)["loss"]
        loss.backward()
        if hasattr(obj, "update_target") and not name.endswith("_noema"):
            obj.update_target(0.5)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        counts = count_step(step)
    for p in obj.parameters():
        p.grad = None
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.syncs.items())) or "-"
    return {"aten_ops": counts.ops, "host_syncs": counts.num_syncs, "sync_kinds": kinds,
            "host_copies": counts.num_host_copies}


def _timed_steps(objectives: dict[str, nn.Module], batch: tuple, *, repeats: int, warmup: int, seed: int,
                 amp: str) -> dict[str, list[float]]:
    """Seconds of each objective's steps after ``warmup``, in a rotated round-robin (shared machine noise, no
    systematic advantage for whoever runs first in a round); step i draws the same sizes in every variant."""
    device = batch[0].device
    optimizers = {name: torch.optim.AdamW([p for p in obj.parameters() if p.requires_grad], lr=1e-4)
                  for name, obj in objectives.items()}
    times: dict[str, list[float]] = {name: [] for name in objectives}
    names = list(objectives)
    for i in range(warmup + repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:
            _sync(device)
            gen = torch.Generator().manual_seed(seed + i)
            start = time.perf_counter()
            train_step(name, objectives[name], optimizers[name], batch, gen, amp=amp)
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def step_times(builders: dict[str, Callable[[], nn.Module]], *, batch: int = 64, img_size: int | None = None,
               in_chans: int | None = None, num_classes: int = 10, repeats: int = 10, warmup: int = 2,
               seed: int = 0, device: str | torch.device = "cpu", peak_gflops: float | None = None,
               amp: str = "no", counts: bool = True) -> list[dict[str, Any]]:
    """Median step time and FLOPs of each objective, with ratios to ``supervised`` (must be among them), training
    samples/s and achieved GFLOP/s (FLOPs counted on the step, :func:`.flops.step_flops`, / step time; as a
    fraction of ``peak_gflops`` when given), and with ``counts`` the ATen ops and host syncs of one step
    (:func:`step_counts`; not for torch.compile'd objectives). Inputs default to the supervised backbone's shape.
    Objectives with an EMA target encoder also run its update, unless their name ends in ``_noema``.
    ``amp="bf16"``: forward under bf16 autocast (AdamW in fp32)."""
    device = torch.device(device)
    torch.manual_seed(seed)
    objectives = {name: build().to(device) for name, build in builders.items()}
    c, h, _ = _input_shape(objectives["supervised"])
    images = torch.randn(batch, in_chans or c, img_size or h, img_size or h, device=device)
    labels = torch.randint(0, num_classes, (batch,), device=device)
    times = _timed_steps(objectives, (images, labels), repeats=repeats, warmup=warmup, seed=seed, amp=amp)
    flops = {name: step_flops(obj, (images, labels)) / batch for name, obj in objectives.items()}
    base_t, base_f = statistics.median(times["supervised"]), flops["supervised"]
    rows = []
    for name, obj in objectives.items():
        t, f = statistics.median(times[name]), flops[name]
        achieved = f * batch / t / 1e9
        row = {"name": f"pretrain_step/{name}", "step_ms": round(t * 1e3, 1),
               "time_vs_supervised": round(t / base_t, 3), "gflops_per_sample": round(f / 1e9, 4),
               "flop_ratio": round(f / base_f, 3), "samples_per_s": round(batch / t, 1),
               "achieved_gflops": round(achieved, 2)}
        if peak_gflops:
            row["peak_fraction"] = round(achieved / peak_gflops, 3)
        if counts and not name.endswith("+compile"):
            row.update(step_counts(name, obj, (images, labels), amp))
        row.update({"batch": batch, "threads": torch.get_num_threads(), "device": str(device), "amp": amp})
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- memory
def _proc_status_mb(field: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of /proc/self/status in MiB (Linux); None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def _rss_mb() -> float:
    """Current resident set size."""
    rss = _proc_status_mb("VmRSS")
    return rss if rss is not None else _peak_rss_mb()


def _peak_rss_mb() -> float:
    """Peak resident set size of this process image. Linux: ``VmHWM`` — not ``ru_maxrss``, which a spawned child
    inherits from its parent's RSS at fork time (it survives exec), so it would report the parent's size."""
    hwm = _proc_status_mb("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere


def step_memory(name: str, *, preset: str = "vit_cpu", in_chans: int = 1, num_classes: int = 10,
                img_size: int | None = None, widths: str = "study", batch: int = 64, steps: int = 2,
                device: str = "cpu", threads: int | None = None, amp: str = "no",
                mp3_etas: tuple[float, ...] = MP3_ETAS, mae_ratios: tuple[float, ...] = ()
                ) -> dict[str, Any]:
    """Memory of ``steps`` training steps of objective ``name`` (of :func:`default_objectives`) in THIS process:
    ``rss_before_mb`` (RSS with the model, optimizer and batch built, before the first step), ``peak_rss_mb``
    (the process's RSS high-water mark after the steps) and ``step_rss_mb`` = their difference (activations,
    gradients, AdamW state, allocator caches); ``cuda_peak_mb`` (``torch.cuda.max_memory_allocated``) on CUDA.
    Honest only in a fresh process: use :func:`isolated_step_memory`."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    torch.manual_seed(0)
    builders = default_objectives(preset, in_chans=in_chans, num_classes=num_classes, img_size=img_size,
                                  widths=widths, mp3_etas=mp3_etas,
                                  mae_ratios=mae_ratios)
    obj = builders[name]().to(dev)
    c, h, _ = _input_shape(obj)
    batch_data = (torch.randn(batch, c, h, h, device=dev), torch.randint(0, num_classes, (batch,), device=dev))
    optimizer = torch.optim.AdamW([p for p in obj.parameters() if p.requires_grad], lr=1e-4)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    before = _rss_mb()
    for _ in range(steps):
        train_step(name, obj, optimizer, batch_data, amp=amp)
    _sync(dev)
    peak = _peak_rss_mb()
    row = {"name": f"memory/{name}", "rss_before_mb": round(before, 1), "peak_rss_mb": round(peak, 1),
           "step_rss_mb": round(max(peak - before, 0.0), 1), "steps": steps, "batch": batch}
    if dev.type == "cuda":
        row["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
    return row


def isolated_step_memory(name: str, **kwargs: Any) -> dict[str, Any]:
    """:func:`step_memory` in a fresh (spawned) Python process, so the high-water mark is this objective's alone."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from patchplace.models import get_attention_kernel

    kwargs.setdefault("threads", torch.get_num_threads())
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_with_kernel, get_attention_kernel(), step_memory, name, **kwargs).result()


def _with_kernel(kernel: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` under the attention kernel of the parent process (a spawned process starts at the default)."""
    from patchplace.models import attention_kernel

    with attention_kernel(kernel):
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- saved bytes
def saved_bytes(objective: nn.Module, batch: int, *, amp: str = "bf16", kernel: str = "sdpa", seed: int = 0,
                device: str | torch.device = "cpu") -> int:
    """Bytes of the activations autograd saves for backward in one training forward of ``objective`` on
    ``batch`` samples: the distinct storages packed by ``torch.autograd.graph.saved_tensors_hooks`` (a view of
    a saved tensor costs nothing more), parameters excluded. Under ``amp="bf16"`` the autocast dtypes are those
    of GPU autocast for the ops of these models (LayerNorm in fp32, projections in bf16; the ``math`` kernel's
    softmax in fp32), so the count does not depend on the device it runs on."""
    from patchplace.models import attention_kernel

    device = torch.device(device)
    obj = unwrap(objective).to(device).train()
    params = {p.untyped_storage().data_ptr() for p in obj.parameters()}
    c, h, w = _input_shape(obj)
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, c, h, w, generator=g).to(device)
    labels = torch.randint(0, 10, (batch,), generator=g).to(device)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    kwargs = {"generator": torch.Generator().manual_seed(seed)} if _takes_generator(obj) else {}
    with attention_kernel(kernel), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            _autocast(device, amp):
        loss = obj((images, labels), progress=0.5, **kwargs)["loss"]
    del loss
    return sum(storages.values())


def saved_bytes_per_sample(objective: nn.Module, **kwargs: Any) -> float:
    """Activation bytes saved for backward per sample: :func:`saved_bytes` at batch 2 minus batch 1 (what does not
    grow with the batch, e.g. low-precision copies of the weights, cancels)."""
    return float(saved_bytes(objective, 2, **kwargs) - saved_bytes(objective, 1, **kwargs))


def saved_bytes_table(preset: str = "vit_base", etas: tuple[float, ...] = (0.3, 0.5, 0.75, 0.9), *,
                      kernels: tuple[str, ...] = ("sdpa", "math"), amp: str = "bf16", in_chans: int = 3,
                      num_classes: int = 1000, device: str | torch.device = "cpu") -> list[dict[str, Any]]:
    """MP3 Table 2's memory column, device-independent: saved bytes per sample of MP3 at each eta and of the
    supervised step (``preset``: ViT-B/16 at 224 px by default), per attention kernel, with their ratios. Each
    objective is built once (seed 0) and measured on every kernel from the RNG state it was built with."""
    builders: dict[float | None, Callable[[], nn.Module]] = {
        None: lambda: Supervised(create_model(preset, in_chans=in_chans, num_classes=num_classes)),
        **{eta: (lambda eta=eta: MP3(create_model(preset, in_chans=in_chans, pos_embed="none"), MP3Config(eta=eta)))
           for eta in etas}}
    per_sample: dict[tuple[float | None, str], float] = {}
    for eta, build in builders.items():
        torch.manual_seed(0)
        objective, state = build(), torch.get_rng_state()
        for kernel in kernels:
            torch.set_rng_state(state)
            per_sample[eta, kernel] = saved_bytes_per_sample(objective, amp=amp, kernel=kernel, device=device)
        del objective
    rows = []
    for kernel in kernels:
        base = per_sample[None, kernel]
        rows.append({"name": "supervised", "kernel": kernel, "eta": None, "mib_per_sample": round(base / 2**20, 2),
                     "vs_supervised": 1.0})
        for eta in etas:
            got = per_sample[eta, kernel]
            rows.append({"name": f"mp3_eta{eta:g}", "kernel": kernel, "eta": eta,
                         "mib_per_sample": round(got / 2**20, 2), "vs_supervised": round(got / base, 3)})
    return rows
