"""benchmark.md and the figure: one table per suite headed by the hardware line (with each suite's note), the GPU
section that mp3_table2 splices into benchmark.md, and time ratio vs FLOP ratio per objective."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from patchplace.research.benchmarks.mp3 import MP3_PAPER, MP3_TABLE2

GPU_SECTION = ("<!-- gpu section: written by benchmark.py --suite mp3_table2 -->", "<!-- end of gpu section -->")


GPU_NOTE = ("Each row: a fresh process, ViT-B/16 at 224 px (paper widths, MP3 at eta 0.75, MJP's "
            "jigsaw on every step), bf16 autocast, fused AdamW. step ms: wall time per step over the "
            "timed steps (synchronised at their ends); GPU busy ms: the union of the kernels' "
            "intervals per step under torch.profiler, busy share = busy / the profiled step's wall "
            "time (well below 1: the host, not the GPU, sets the pace). FLOPs: counted on the step "
            "(FlopCounterMode). of bf16 peak: achieved TFLOP/s over the best bf16 GEMM of the same "
            "run. ATen ops / host syncs / host copies: one eager step's forward, backward and EMA "
            "update (patchplace.objectives.audit). first step s: the first step, compilation "
            "included; recompiles: graphs compiled during the timed steps. Paper: MP3 Table 2 (one "
            "A100; MAE's row at 0.75).")


TABLES = {  # suite -> (title, [(column header, row key)])
    "matmul": ("fp32 matmul peak", [("benchmark", "name"), ("best GFLOP/s", "gflops"),
                                    ("median GFLOP/s", "median_gflops"), ("device", "device")]),
    "objectives": ("Pretraining step per objective (forward + backward + AdamW), relative to supervised", [
        ("objective", "name"), ("step ms", "step_ms"), ("time ratio", "time_vs_supervised"),
        ("FLOP ratio", "flop_ratio"), ("samples/s", "samples_per_s"), ("GFLOP/sample", "gflops_per_sample"),
        ("achieved GFLOP/s", "achieved_gflops"), ("of peak", "peak_fraction"), ("peak RSS MB", "peak_rss_mb"),
        ("steps' RSS MB", "step_rss_mb"), ("CUDA peak MB", "cuda_peak_mb"), ("ATen ops / step", "aten_ops"),
        ("host syncs / step", "host_syncs"), ("syncs by kind", "sync_kinds")]),
    "masks": ("Mask generation per batch (before / after: the optimization's one-run comparison, kept from the run "
              "that made it)", [("generator", "name"), ("ms", "ms"), ("before ms", "before_ms"),
                                ("after ms", "after_ms"), ("speed-up", "speedup")]),
    "data": ("Data path", [("benchmark", "name"), ("samples/s", "samples_per_s"), ("clips/s", "clips_per_s"),
                           ("batch", "batch_size"), ("samples", "samples"), ("seconds", "seconds")]),
    "data_writer": ("Image-folder shard writer per --writer-workers, and JPEG decoding on one core: Pillow vs "
                    "torchvision.io.decode_jpeg (generated JPEGs of varying sizes)", [
        ("benchmark", "name"), ("images/s", "images_per_s"), ("images/s per core", "images_per_s_per_core"),
        ("workers", "workers"), ("same bytes", "identical_to_first"), ("vs Pillow", "vs_pil"),
        ("max abs diff", "max_abs_diff"), ("identical images", "identical_images"), ("images", "images"),
        ("seconds", "seconds")]),
    "probe_memory": ("evaluate.py's streamed probes: peak anonymous memory vs the train split's size (the feature "
                     "store on disk, the linear probes, the 1% logistic regression, the layer-wise kNN)", [
        ("benchmark", "name"), ("train samples", "train_samples"), ("peak RssAnon MB", "peak_rss_anon_mb"),
        ("added RssAnon MB", "added_rss_anon_mb"), ("peak, fixed mmap threshold", "peak_rss_anon_fixed_mmap_mb"),
        ("added, fixed mmap threshold", "added_rss_anon_fixed_mmap_mb"), ("store MB", "store_mb"),
        ("seconds", "seconds"),
        ("linear probe top-1", "linear_probe_top1"), ("kNN top-1 (last block)", "knn_top1_last")]),
    "data_vs_training": ("Data loader samples/s vs what training consumes (study ViT; measured apart — in training "
                         "both share the cores)", [
                             ("loader workers", "num_workers"), ("loader samples/s", "loader_samples_per_s"),
                             ("supervised training samples/s", "supervised_samples_per_s"),
                             ("headroom", "headroom_supervised"), ("fastest objective", "fastest_objective"),
                             ("its samples/s", "fastest_samples_per_s"), ("headroom ", "headroom_fastest")]),
    "models": ("One block fwd + bwd: MP3 context-only K/V vs full attention", [
        ("benchmark", "name"), ("preset", "preset"), ("batch", "batch"), ("tokens", "tokens"),
        ("full ms", "full_ms"), ("context ms", "context_ms"), ("time ratio", "time_vs_full"),
        ("FLOP ratio", "flop_ratio")]),
    "onnx": ("Inference: PyTorch eager vs ONNX Runtime — plain graph (before) vs optimized graph and its int8 "
             "variant (after), same run and threads", [
        ("model / batch", "name"), ("PyTorch p50 ms", "torch_p50_ms"), ("plain p50 ms", "plain_p50_ms"),
        ("optimized p50 ms", "optimized_p50_ms"), ("int8 p50 ms", "int8_p50_ms"),
        ("plain speed-up", "plain_speedup"), ("optimized speed-up", "optimized_speedup"),
        ("int8 speed-up", "int8_speedup"), ("optimized / plain", "optimized_vs_plain"),
        ("optimized images/s", "optimized_images_per_s"), ("threads", "threads"), ("fused", "fused"),
        ("ORT provider", "providers")]),
    "mp3_table2": ("GPU: MP3 Table 2 and every objective's step (step time and peak memory vs the supervised "
                   "ViT, same run, per attention kernel)", [
        ("objective", "name"), ("attention", "kernel"), ("masking ratio", "masking_ratio"), ("step ms", "step_ms"),
        ("time ratio", "time_vs_supervised"), ("paper time ratio", "paper_time_ratio"),
        ("CUDA peak MB", "cuda_peak_mb"), ("memory ratio", "memory_vs_supervised"),
        ("paper memory ratio", "paper_memory_ratio"), ("FLOP ratio", "flop_ratio"),
        ("time / FLOP ratio", "time_per_flop"), ("within 10%", "tracks_flops"),
        ("samples/s", "samples_per_s"), ("achieved GFLOP/s", "achieved_gflops"), ("device", "device")]),
    "gpu": ("GPU: every objective's training step, eager and torch.compile'd (a process per row; ratios to the "
            "supervised step of the same mode)", [
        ("objective", "name"), ("step ms", "step_ms"), ("GPU busy ms", "gpu_busy_ms"), ("busy share", "busy_share"),
        ("time ratio", "time_vs_supervised"), ("FLOP ratio", "flop_ratio"), ("time / FLOP ratio", "time_per_flop"),
        ("within 10%", "tracks_flops"), ("CUDA peak MB", "cuda_peak_mb"), ("memory ratio", "memory_vs_supervised"),
        ("paper time ratio", "paper_time_ratio"), ("paper memory ratio", "paper_memory_ratio"),
        ("TFLOP/step", "tflops_per_step"), ("achieved TFLOP/s", "achieved_tflops"), ("of bf16 peak", "of_peak"),
        ("ATen ops", "aten_ops"), ("host syncs", "host_syncs"), ("host copies", "host_copies"),
        ("first step s", "first_step_s"), ("graph breaks", "graph_breaks"), ("recompiles", "recompiles"),
        ("note", "note")]),
    "saved_bytes": ("MP3 Table 2's memory, device-independent: activation bytes saved for backward per sample", [
        ("objective", "name"), ("attention kernel", "kernel"), ("eta", "eta"), ("MiB / sample", "mib_per_sample"),
        ("vs supervised", "vs_supervised"), ("paper memory ratio", "paper_memory_ratio"), ("preset", "preset"),
        ("autocast", "amp")]),
    "activation_memory": ("run.activation_checkpointing: tensor memory of one training step without / with every "
                          "Transformer block recomputing its activations in the backward", [
        ("width / method", "name"), ("blocks", "blocks"), ("held MiB", "held_mib"), ("held, ckpt MiB", "held_ckpt_mib"),
        ("held ratio", "held_ratio"), ("peak MiB", "peak_mib"), ("peak, ckpt MiB", "peak_ckpt_mib"),
        ("peak ratio", "peak_ratio"), ("of which gradients MiB", "grads_mib"), ("depth", "depth"),
        ("batch", "batch"), ("autocast", "amp")]),
    "fsdp_memory": ("run.fsdp / run.activation_checkpointing: per-rank peak memory of one training step on 2 CPU "
                    "processes", [
        ("width / method / mode", "name"), ("peak MiB", "peak_mib"), ("vs DDP", "vs_ddp"),
        ("weights + AdamW MiB", "state_mib"), ("step s", "step_s"), ("depth", "depth"),
        ("batch / rank", "batch_per_rank")]),
    "ddp": ("pretrain.py on one process vs two (gloo, same global batch), and DDP's find_unused_parameters", [
        ("method", "name"), ("setting", "ddp_setting"), ("samples/s (median)", "samples_per_s"), ("runs", "runs"),
        ("vs 1 process", "vs_one_process"), ("vs find_unused off", "vs_find_unused_off"),
        ("global batch", "global_batch"), ("steps", "steps"), ("preset", "preset")]),
    "anchor": ("Anchor: our supervised baseline vs a plain timm ViT loop (same size, data, epochs, recipe)", [
        ("training", "name"), ("test top-1", "top1"), ("samples/s", "samples_per_s"), ("epochs", "epochs"),
        ("seed", "seed"), ("preset", "preset"), ("batch", "batch")]),
    "speed": ("The study ViT at GPU speed: images/s of each method's training per rung (each rung adds to the one "
              "before; a process per run, in-memory path, steady steps)", [
        ("method", "name"), ("rung", "setting"), ("batch", "batch"), ("processes", "processes"),
        ("images/s", "images_per_s"), ("vs before", "vs_first"), ("GFLOP/image", "gflops_per_image"),
        ("of peak", "peak_fraction"), ("fastest", "fastest"), ("autocast", "amp"), ("device", "device"),
        ("overrides", "overrides")]),
    "cpu_speed": ("The CPU speed ladder: images/s of each method's training per rung (a process per run, in-memory "
                  "path, steady steps), over the fp32 rung's, and the fraction of the fp32 / bf16 matmul peaks", [
        ("model / method", "name"), ("rung", "rung"), ("images/s", "images_per_s"), ("vs fp32", "vs_fp32"),
        ("threads", "threads"), ("processes", "processes"), ("GFLOP/image", "gflops_per_image"),
        ("achieved GFLOP/s", "achieved_gflops"), ("of fp32 peak", "of_fp32_peak"),
        ("of bf16 peak", "of_bf16_peak"), ("fastest", "fastest"), ("steps", "steps"), ("batch", "batch")]),
    "cpu_equivalence": ("bf16 vs float32 training, seed-paired on the validation split: TOST at alpha 0.05, "
                        "margin +-1 pt (bf16 - float32)", [
        ("method", "name"), ("measure", "measure"), ("fp32 per seed", "fp32"), ("bf16 per seed", "bf16"),
        ("mean diff", "mean_diff"), ("90% CI", "ci90"), ("95% CI", "ci95"), ("p (difference)", "p_difference"),
        ("margin", "margin"), ("equivalent", "equivalent"), ("bf16 kernels", "bf16_kernels")]),
    "profile": ("Where a training step's time goes (torch.profiler; self time per step, device time on a GPU)", [
        ("objective", "name"), ("operator", "op"), ("ms / step", "ms_per_step"), ("share", "share"),
        ("calls / step", "calls_per_step"), ("compute", "compute"), ("outside compute", "non_compute_share"),
        ("preset", "preset"), ("batch", "batch"), ("autocast", "amp"), ("device", "device")]),
    "pipelines": ("End-to-end pretraining through pretrain.py per data path, vs the same loop on one repeated "
                  "batch (pure step; medians of alternated runs, startup excluded)", [
        ("method", "name"), ("data path", "path"), ("samples/s", "samples_per_s"),
        ("end-to-end ratio", "end_to_end_ratio"), ("runs", "runs"), ("data-wait share", "data_share"),
        ("startup s", "startup_s"), ("batch", "batch"), ("workers", "num_workers"), ("steps", "steps"),
        ("preset", "preset")]),
}


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> list[str]:
    columns = [(h, k) for h, k in columns if any(k in r for r in rows)]
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        cells = []
        for _, key in columns:
            value = r.get(key, "")
            cells.append(value.split("/", 1)[1] if key == "name" and isinstance(value, str) and "/" in value
                         else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# what each suite's table measures, printed under it
SUITE_NOTES = {
    "objectives": (
        "Time ratio: median step time / the supervised step's in the same rotated round-robin "
        "run. FLOP ratio: FLOPs counted on the step (FlopCounterMode: matrix products, "
        "convolutions, attention; forward and backward). Achieved GFLOP/s = FLOP/sample x batch / "
        "step time; "
        "'of peak' divides by the fp32 matmul peak. Peak RSS: the high-water mark of a fresh "
        "process that builds only this objective and runs its steps; steps' RSS: what the steps "
        "added to the RSS of the built model (activations, gradients, AdamW state, allocator "
        f"caches). MP3 paper (ViT-B): wall-clock ratio {MP3_PAPER['time_ratio']} at eta = "
        f"{MP3_PAPER['eta']}, FLOP bound ~{MP3_PAPER['flop_bound']}. ATen ops / host syncs: "
        "one step's forward, backward and EMA update (patchplace.objectives.audit.count_step; "
        "the optimizer, the same for all, left out)."
    ),
    "onnx": (
        "plain: the standard-ONNX graph of the training model's attention (`python -m "
        "patchplace.export --no-optimize`) on a default ONNX Runtime session, as exported before "
        "the optimizer; optimized: the default export (ONNX Runtime's fused Attention / BiasGelu, "
        "SkipLayerNormalization split back into Add + LayerNormalization) through `onnx_session`; "
        "int8: its dynamic-quantized variant (`--quantize`). Speed-up: PyTorch p50 / this p50 in "
        "the same run; every runner on the same number of threads."
    ),
    "ddp": (
        "samples/s: the last log line of pretrain.py (every step; process start-up excluded), "
        "median of the alternated runs listed. On one machine the 2 processes share its cores, "
        "so 2 vs 1 process measures DDP's overhead, not a speed-up. 'vs find_unused off': what "
        "DDP's find_unused_parameters costs (no method needs it now: MJP's jigsaw is selected on the device; "
        "here it also shuffles every step). Differences smaller than the spread of the runs are noise."
    ),
    "fsdp_memory": (
        "Each (width, method): a fresh pair of processes (gloo, 1 thread each), fp32, each rank "
        "its half of the batch. peak: the resident set's high-water mark during the second step "
        "(the first made AdamW's moments) above the resident set before the model was built, "
        "the larger rank's. weights + AdamW: what a rank keeps between steps (a shard's local "
        "part under FSDP). ddp: DistributedDataParallel (every rank the whole model, and its "
        "gradient buckets); ckpt: every Transformer block recomputing its activations; fsdp: "
        "FSDP2's fully_shard as run.fsdp=full_shard applies it (a unit per block, gathered for "
        "its forward and again for its backward). step s: noisy on a shared CPU."
    ),
    "saved_bytes": (
        "Bytes of the distinct storages autograd saves for backward in one training forward "
        "(torch.autograd.graph.saved_tensors_hooks; parameters excluded), batch 2 minus batch 1: "
        "the activations a step keeps, whatever the device and its allocator. Autocast dtypes "
        "are GPU autocast's for these ops (LayerNorm fp32, projections bf16, the math kernel's "
        "softmax fp32). sdpa: the fused kernel (saves q, k, v, output, log-sum-exp); math: the "
        "materialised softmax of the paper's time (also saves the N x K probabilities). Paper: "
        "MP3 Table 2's GB per batch over the ViT-B baseline's (A100, batch not stated)."
    ),
    "activation_memory": (
        "Counted on the step (a TorchDispatchMode over every op: a storage counts from the op that "
        "allocates it until it is freed; weights and the input batch excluded). held: the tensors "
        "alive between forward and backward, what the backward needs; peak: the most alive at any "
        "point of forward + backward, the parameter gradients included. blocks: the Transformer "
        "blocks that recompute (the backbone's and the decoders' / predictors', at the paper's "
        "widths). A checkpointed block keeps only its input; the peak then comes in the backward "
        "(one block's recomputed activations beside the gradients). The cost, about one more "
        "forward of the blocks per step, is not tabled: the JSON's step_s / step_ckpt_s are one "
        "eager step each, too noisy on a shared CPU to compare."
    ),
    "gpu": (
    GPU_NOTE
    ),
    "mp3_table2": (
        "Time / memory ratio: this objective's median step time / peak CUDA memory (a fresh "
        "process per objective: weights, AdamW state, activations) over the supervised ViT's, "
        "same run and batch; the forward runs under the stated autocast, AdamW in fp32. Paper: "
        "MP3 Table 2, seconds per iteration and GB per batch on one A100 over the ViT-B "
        f"baseline's ({MP3_TABLE2['vit_b']['time']} s, {MP3_TABLE2['vit_b']['memory']} GB; "
        "its batch size is not stated). FLOP ratio: counted on the step; time / FLOP ratio: how far "
        "the "
        "step's time is from what its FLOPs say (within 10%: |time / FLOP ratio - 1| <= 0.1). "
        "Attention: sdpa is the fused kernel, math the materialised softmax (the paper's time). "
        "`+compile` rows: torch.compile'd objectives, their time ratio over the compiled "
        "supervised step."
    ),
}


def to_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    hardware = f"_Hardware: {meta['hardware']}"
    if meta.get("matmul_peak"):
        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(meta["matmul_peak"].get("name", "/float32").split("/")[1])
        hardware += f"; {dtype} matmul peak {meta['matmul_peak']['gflops']} GFLOP/s"
    if meta.get("bf16_matmul_peak"):
        hardware += f"; bf16 matmul peak {meta['bf16_matmul_peak']['gflops']} GFLOP/s"
    if meta.get("cpu"):
        cpu = meta["cpu"]
        hardware += (f"; CPU {cpu['name']}, flags {' '.join(cpu['flags']) or 'none'}, bf16 units: "
                     f"{cpu['bf16_units'] or 'none'}")
    hardware += "_"
    lines = [f"# Benchmarks (`--suite {meta['suite']}`)", ""]
    for suite, (title, columns) in TABLES.items():
        chunk = [r for r in rows if r.get("suite") == suite]
        if not chunk:
            continue
        groups: dict[str, list[dict[str, Any]]] = {}
        by_setting = all(key != "setting" for _, key in columns)  # a column of its own (speed's rung): one table
        for r in chunk:
            groups.setdefault(r.get("setting", "") if by_setting else "", []).append(r)
        for setting, group in groups.items():
            lines += [f"## {title}" + (f" — {setting}" if setting else ""), "", hardware, ""]
            lines += _table(group, columns)
            lines.append("")
            if suite in SUITE_NOTES:
                lines += [SUITE_NOTES[suite], ""]
            if suite == "anchor":
                lines += [anchor_summary(group), ""]
    if meta.get("seconds"):
        lines += ["Seconds per part: " + ", ".join(f"{k} {v}" for k, v in meta["seconds"].items()), ""]
    return "\n".join(lines)


def anchor_summary(rows: list[dict[str, Any]]) -> str:
    """Mean top-1 of both loops and their seed-paired difference (ours - plain), in points."""
    ours = {r["seed"]: r["top1"] for r in rows if r["name"].startswith("anchor/patchplace")}
    plain = {r["seed"]: r["top1"] for r in rows if r["name"] == "anchor/plain timm loop"}
    seeds = sorted(set(ours) & set(plain))
    if not seeds:
        return "No seed has both loops."
    diff = [100 * (ours[s] - plain[s]) for s in seeds]
    spread = f" ± {statistics.stdev(diff):.1f}" if len(diff) > 1 else ""
    mean_ours, mean_plain = (100 * statistics.mean(d[s] for s in seeds) for d in (ours, plain))
    return (f"Seeds {', '.join(map(str, seeds))}: ours {mean_ours:.2f}%, plain timm loop {mean_plain:.2f}%; "
            "ours - plain "
            f"{statistics.mean(diff):+.2f}{spread} pt (seed-paired). Both: the study's supervised recipe "
            "(AdamW without decay on biases / norms, label smoothing, warm-up + cosine, no Mixup / CutMix / layer "
            "decay, crops of area [0.8, 1]) on the same in-memory split and batched augmentation; top-1 on the "
            "whole test split.")


def gpu_section(text: str) -> str:
    """The GPU section (between the :data:`GPU_SECTION` markers) of markdown ``text``; "" if none."""
    start, end = GPU_SECTION
    if start not in text or end not in text:
        return ""
    return text[text.index(start) + len(start): text.index(end)].strip("\n")


def splice_gpu_section(text: str, section_markdown: str) -> str:
    """Markdown ``text`` with its GPU section replaced by ``section_markdown`` (appended when it has none; dropped
    when ``section_markdown`` is empty). Its ``# title`` line is left out of the section."""
    start, end = GPU_SECTION
    if start in text and end in text:
        text = text[: text.index(start)].rstrip("\n") + "\n" + text[text.index(end) + len(end):].lstrip("\n")
    body = "\n".join(line for line in section_markdown.strip("\n").splitlines() if not line.startswith("# "))
    if not body.strip():
        return text
    return text.rstrip("\n") + f"\n\n{start}\n{body.strip()}\n{end}\n"


def plot_objectives(rows: list[dict[str, Any]], path: Path) -> bool:
    """Time ratio vs FLOP ratio per objective, one panel per backbone setting; False when there is nothing."""
    chunk = [r for r in rows if r.get("suite") == "objectives"]
    settings = list(dict.fromkeys(r["setting"] for r in chunk))
    if not settings:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 5), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        group = [r for r in chunk if r["setting"] == setting]
        xs, ys = [r["flop_ratio"] for r in group], [r["time_vs_supervised"] for r in group]
        ax.scatter(xs, ys, zorder=3)
        for r, x, y in zip(group, xs, ys, strict=True):
            ax.annotate(r["name"].split("/", 1)[1], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.scatter([MP3_PAPER["flop_bound"]], [MP3_PAPER["time_ratio"]], marker="*", s=120, color="tab:red",
                   zorder=3, label="MP3 paper, eta 0.75 (ViT-B)")
        top = max(xs + ys + [1.0]) * 1.08
        ax.plot([0, top], [0, top], color="gray", lw=0.8, ls="--", label="time ratio = FLOP ratio")
        ax.set(xlim=(0, top), ylim=(0, top), xlabel="FLOP ratio vs supervised (from shapes)",
               ylabel="step time ratio vs supervised (same run)", title=setting)
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
