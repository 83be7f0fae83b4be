"""pipelines/benchmark.py: suites run end to end at toy sizes and write JSON + markdown (hardware line on every table)
+ the figure; the measuring functions they call (FLOP model, step times, memory, saved bytes, masks, the attention
block, the matmul peak, shard reads) on their own; no timing assertions."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import pytest
import torch

from patchplace.models import create_model
from patchplace.objectives import MP3, MP3Config, Supervised
from patchplace.research import benchmark
from patchplace.research.benchmarks.compute import context_attention, matmul_peak
from patchplace.research.benchmarks.data import data_vs_training, shard_read_throughput
from patchplace.research.benchmarks.flops import block_flops, train_flops
from patchplace.research.benchmarks.report import GPU_SECTION, anchor_summary
from patchplace.research.benchmarks.steps import (
    default_objectives,
    mask_times,
    saved_bytes,
    saved_bytes_per_sample,
    saved_bytes_table,
    step_memory,
    step_times,
)

ROOT = Path(__file__).resolve().parents[1]


def test_help_documents_every_suite(capsys):
    with contextlib.suppress(SystemExit):
        benchmark.main(["--help"])
    text = capsys.readouterr().out
    for suite in benchmark.SUITES:
        assert f"\n  {suite} " in text, suite


def test_objectives_suite_writes_json_markdown_and_figure(tmp_path):
    out = tmp_path / "bench"
    assert benchmark.main(["--suite", "objectives", "--batch", "2", "--repeats", "1", "--warmup", "0",
                           "--memory-steps", "0", "--objectives", "mp3_eta0.75",
                           "--matmul-size", "128", "--out", str(out)]) == 0
    data = json.loads((out / "benchmark.json").read_text())
    assert data["meta"]["matmul_peak"]["gflops"] > 0 and "cores" in data["meta"]["hardware"]
    rows = {r["name"]: r for r in data["results"]}
    assert set(rows) == {"pretrain_step/supervised", "pretrain_step/mp3_eta0.75"}
    assert rows["pretrain_step/supervised"]["time_vs_supervised"] == 1.0
    mp3 = rows["pretrain_step/mp3_eta0.75"]
    assert 0 < mp3["flop_ratio"] < 1 and mp3["peak_fraction"] > 0
    for row in rows.values():  # what one step asks of the host (patchplace.objectives.audit.count_step)
        assert row["aten_ops"] > 100 and row["host_syncs"] >= 0 and row["host_copies"] == 0
        assert (row["sync_kinds"] == "-") == (row["host_syncs"] == 0)
    assert rows["pretrain_step/supervised"]["host_syncs"] == 0
    markdown = (out / "benchmark.md").read_text()
    assert markdown.count("_Hardware: ") == markdown.count("\n## ") >= 1
    assert "fp32 matmul peak" in markdown and (out / "benchmark_objectives.png").stat().st_size > 0
    assert "| ATen ops / step | host syncs / step |" in markdown


def test_masks_suite_and_data_vs_training(tmp_path):
    assert benchmark.main(["--suite", "masks", "--mask-repeats", "1", "--vits-batch", "2",
                           "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "benchmark.json").read_text())["results"]
    assert len(rows) == 4 and all(r["ms"] > 0 for r in rows)
    study = benchmark.STUDY["preset"]
    fake = [{"suite": "data", "name": "shard_read/x/train/workers=1", "num_workers": 1, "samples_per_s": 300.0},
            {"suite": "objectives", "preset": study, "name": "pretrain_step/supervised", "samples_per_s": 100.0},
            {"suite": "objectives", "preset": study, "name": "pretrain_step/mae", "samples_per_s": 150.0},
            {"suite": "objectives", "preset": study, "name": "pretrain_step/ijepa_before", "samples_per_s": 900.0}]
    [row] = data_vs_training(fake)
    assert row["headroom_supervised"] == 3.0 and row["fastest_objective"] == "mae" and row["headroom_fastest"] == 2.0


@pytest.mark.slow
def test_onnx_suite_times_before_and_after_in_one_run(tmp_path):
    """The plain graph (before), the optimized graph and its int8 variant (after) against PyTorch, same threads."""
    assert benchmark.main(["--suite", "onnx", "--onnx-preset", "vit_micro", "--onnx-batches", "1", "2",
                           "--onnx-repeats", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "benchmark.json").read_text())["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["fused"] == "Attention x2, BiasGelu x2" and r["threads"] == 1
        for name in ("plain", "optimized", "int8"):
            assert r[f"{name}_speedup"] == round(r["torch_p50_ms"] / r[f"{name}_p50_ms"], 2)
        assert r["optimized_vs_plain"] == round(r["plain_p50_ms"] / r["optimized_p50_ms"], 2)
    assert "| optimized speed-up |" in (tmp_path / "benchmark.md").read_text()


def test_markdown_heads_every_table_with_the_hardware_line():
    meta = {"suite": "all", "hardware": benchmark.hardware_line(), "matmul_peak": {"gflops": 50.0}}
    rows = [{"suite": "matmul", "name": "matmul_peak/float32/64", "gflops": 50.0, "median_gflops": 40.0,
             "device": "cpu"},
            {"suite": "onnx", "name": "inference/vit/batch1", "optimized_p50_ms": 1.0, "torch_p50_ms": 2.0}]
    text = benchmark.to_markdown(rows, meta)
    sections = text.split("\n## ")[1:]
    assert len(sections) == 2
    for section in sections:
        assert section.splitlines()[2] == f"_Hardware: {meta['hardware']}; fp32 matmul peak 50.0 GFLOP/s_"
    assert "torch" in meta["hardware"] and ("GPU" in meta["hardware"])


def test_a_ladder_is_one_table_with_a_row_per_rung():
    """The speed suite's rungs are a column of one table (its "setting" is the rung), not a section each."""
    meta = {"suite": "speed", "hardware": "h"}
    rows = [{"suite": "speed", "name": "speed/mp3", "setting": rung, "images_per_s": rate}
            for rung, rate in (("before", 1.0), ("fused", 2.0))]
    text = benchmark.to_markdown(rows, meta)
    assert text.count("\n## ") == 1 and "| mp3 | before | 1.0 |" in text and "| mp3 | fused | 2.0 |" in text


@pytest.mark.slow
def test_mp3_table2_suite_reports_ratios_beside_the_paper_per_kernel_and_keeps_its_gpu_section(tmp_path):
    """CPU stand-in for the GPU run (tiny ViT, bf16 autocast): paper ratios, memory ratios and time / FLOP ratios of
    MP3, MAE and another objective on both attention kernels, and benchmark.md's GPU section written once, replaced
    by the next mp3_table2 run and kept when another suite rewrites the file."""
    (tmp_path / "benchmark.md").write_text("# Benchmarks\n\nearlier tables\n")
    args = ["--suite", "mp3_table2", "--preset", "vit_micro", "--img-size", "32", "--in-chans", "1", "--batch", "2",
            "--repeats", "1", "--warmup", "0", "--memory-steps", "1", "--mp3-etas", "0.75", "--mae-ratios", "0.9",
            "--matmul-size", "64", "--out", str(tmp_path)]
    assert benchmark.main(args) == 0
    data = json.loads((tmp_path / "benchmark_mp3_table2.json").read_text())
    rows = {(r["name"].split("/", 1)[1], r["kernel"]): r for r in data["results"]}
    names = {"supervised", "mp3_eta0.75", "mae_ratio0.9"}
    assert set(rows) == {(n, k) for n in names for k in ("sdpa", "math")} and data["meta"]["attention"] == "sdpa,math"
    for kernel in ("sdpa", "math"):
        assert rows["mp3_eta0.75", kernel]["paper_time_ratio"] == 0.69
        assert rows["mp3_eta0.75", kernel]["paper_memory_ratio"] == 0.72
        assert rows["mae_ratio0.9", kernel]["paper_time_ratio"] == 0.61
        assert rows["supervised", kernel]["memory_vs_supervised"] == 1.0
        for r in (rows[n, kernel] for n in names):
            assert r["time_per_flop"] == round(r["time_vs_supervised"] / r["flop_ratio"], 3)
            assert r["tracks_flops"] == (abs(r["time_per_flop"] - 1) <= 0.1)
    assert rows["supervised", "sdpa"]["time_per_flop"] == 1.0
    assert all(r["amp"] == "bf16" and r["memory_basis"] == "step_rss_mb" for r in rows.values())
    assert data["meta"]["matmul_peak"]["name"].startswith("matmul_peak/bfloat16/")
    markdown = (tmp_path / "benchmark.md").read_text()
    assert "earlier tables" in markdown and markdown.count(GPU_SECTION[0]) == 1
    assert "| mp3_eta0.75 | sdpa | 0.75 |" in markdown and "| mp3_eta0.75 | math | 0.75 |" in markdown
    again = [*args, "--memory-steps", "0", "--kernels", "math"]  # the last flag wins
    assert benchmark.main(again) == 0  # replaced, not appended
    markdown = (tmp_path / "benchmark.md").read_text()
    assert markdown.count(GPU_SECTION[0]) == 1 and "| mp3_eta0.75 | sdpa |" not in markdown
    assert benchmark.main(["--suite", "masks", "--mask-repeats", "1", "--vits-batch", "2", "--out", str(tmp_path)]) == 0
    markdown = (tmp_path / "benchmark.md").read_text()
    assert "Mask generation" in markdown and "earlier tables" not in markdown  # rewritten by the masks suite ...
    assert markdown.count(GPU_SECTION[0]) == 1 and "| mp3_eta0.75 | math | 0.75 |" in markdown  # ... GPU kept


def test_pipelines_suite_measures_each_data_path_against_the_pure_step(shards, tmp_path):
    """Tiny sizes: the three paths really ran (the log says which fed the train split), the pure step's ratio is 1,
    and --update replaces only this suite's rows."""
    out = tmp_path / "bench"
    out.mkdir()
    (out / "benchmark.json").write_text(json.dumps({"meta": {"suite": "all", "hardware": "x", "seconds": {}},
                                                    "results": [{"suite": "matmul", "name": "m/1", "gflops": 1.0}]}))
    assert benchmark.main(["--suite", "pipelines", "--shards", str(shards / "img" / "train"), "--methods", "mae",
                           "--steps", "3", "--pipelines-repeats", "1", "--pipelines-preset", "vit_micro",
                           "--pipelines-batch", "8", "--pipelines-workers", "1", "--out", str(out), "--update",
                           "--pipelines-overrides", "objective.decoder_dim=32", "objective.decoder_depth=1",
                           "objective.decoder_heads=2"]) == 0
    data = json.loads((out / "benchmark.json").read_text())
    rows = {r["path"]: r for r in data["results"] if r["suite"] == "pipelines"}
    assert set(rows) == {"pure_step", "memory", "streaming"} and rows["pure_step"]["end_to_end_ratio"] == 1.0
    assert all(r["name"] == "train/mae" and r["samples_per_s"] > 0 and r["startup_s"] >= 0 for r in rows.values())
    assert rows["streaming"]["num_workers"] == 1 and rows["memory"]["num_workers"] == 0
    assert [r["name"] for r in data["results"] if r["suite"] == "matmul"] == ["m/1"], "other suites' rows kept"
    assert "end-to-end ratio" in (out / "benchmark.md").read_text()


def test_anchor_suite_trains_ours_and_a_plain_timm_loop_on_the_same_data(shards, tmp_path):
    assert benchmark.main(["--suite", "anchor", "--shards", str(shards / "img" / "train"), "--anchor-epochs", "1",
                           "--pipelines-preset", "vit_micro", "--pipelines-batch", "8", "--out", str(tmp_path),
                           "--pipelines-overrides", "data.num_workers=0"]) == 0
    rows = {r["name"].split("/")[1]: r for r in json.loads((tmp_path / "benchmark.json").read_text())["results"]}
    assert set(rows) == {"patchplace supervised (finetune.py)", "plain timm loop"}
    assert all(0 <= r["top1"] <= 1 and r["samples_per_s"] > 0 and r["epochs"] == 1.0 for r in rows.values())
    text = (tmp_path / "benchmark.md").read_text()
    assert "Anchor: our supervised baseline" in text and "ours - plain" in text


def test_anchor_summary_pairs_the_seeds_both_loops_ran():
    rows = [{"name": "anchor/patchplace supervised (finetune.py)", "seed": s, "top1": t}
            for s, t in ((0, 0.80), (1, 0.82), (2, 0.90))]
    rows += [{"name": "anchor/plain timm loop", "seed": s, "top1": t} for s, t in ((0, 0.78), (1, 0.83))]
    text = anchor_summary(rows)
    assert text.startswith("Seeds 0, 1: ours 81.00%, plain timm loop 80.50%; ours - plain +0.50 ± 2.1 pt"), text
    assert anchor_summary(rows[:3]) == "No seed has both loops."


@pytest.mark.slow
def test_speed_suite_times_each_rung_of_the_ladder_through_the_real_pipelines(tmp_path):
    """The GPU speed ladder on a CPU stand-in (tiny ViT, toy shards, 3 steps): the first and the last rung really
    ran pretrain.py with their knobs (the last: compiled, the runs sharing the device as many processes), rates
    relative to the first rung, a peak fraction from the objective's FLOPs, and the fastest rung marked once; the
    rungs between are the ladder's steps from one to the other; fine-tuning runs finetune.py."""
    import numpy as np

    from patchplace.data import SplitWriter
    from patchplace.research.benchmarks.speed import STUDY_GPU_BATCH, Setting, command, ladder

    rng = np.random.default_rng(0)  # the first rung's batch (a GPU study's 256) needs as many images
    with SplitWriter(tmp_path / "img", "train", dataset="toy", modality="image", classes=["a", "b", "c"],
                     info={"image_size": [28, 28], "channels": 1}, source="test", recipe="test",
                     recipe_version=1, max_count=128) as w:
        for i in range(STUDY_GPU_BATCH):
            w.add_image(f"{i:04d}", i % 3, rng.integers(0, 256, (28, 28), dtype=np.uint8))
    out = tmp_path / "bench"
    argv = ["--suite", "speed", "--shards", str(tmp_path / "img" / "train"), "--speed-methods", "mae",
            "--speed-settings", "before", "processes", "--speed-steps", "3", "--speed-batch", "16",
            "--speed-processes", "2", "--speed-compile", "aot_eager", "--matmul-size", "64", "--out", str(out),
            "--pipelines-overrides", "model.preset=vit_micro", "objective.decoder_dim=32",
            "objective.decoder_depth=1", "objective.decoder_heads=2"]
    assert benchmark.main(argv) == 0
    data = json.loads((out / "benchmark_speed.json").read_text())
    rows = {r["setting"]: r for r in data["results"]}
    assert list(rows) == ["before", "processes"] and all(r["name"] == "speed/mae" for r in rows.values())
    before, shared = rows.values()
    assert before["batch"] == 256 and shared["batch"] == 16
    assert before["overrides"] == "optim.fused=false run.finite_check=step run.compile=no"
    assert "run.finite_check=lazy" in shared["overrides"]
    assert "run.compile=aot_eager" in shared["overrides"] and "optim.lr_scaling=linear" in shared["overrides"]
    assert len(shared["process_rates"]) == 2 and shared["images_per_s"] == round(sum(shared["process_rates"]), 1)
    args = benchmark.build_parser().parse_args(argv)
    rungs = {r.name: r for r in ladder(argparse.Namespace(**{**vars(args), "speed_settings": None}))}
    assert list(rungs) == ["before", "fused", "lazy", "batch", "compile", "processes"]
    compiled = rungs["compile"]  # the processes rung is the compile rung, in --speed-processes processes
    assert compiled.batch == 16 and compiled.processes == 1 and " ".join(compiled.overrides) == shared["overrides"]
    assert "run.finite_check=lazy" in compiled.overrides and "run.compile=aot_eager" in compiled.overrides
    assert before["vs_first"] == 1.0 and all(r["images_per_s"] > 0 < r["peak_fraction"] for r in rows.values())
    assert sum(bool(r.get("fastest")) for r in rows.values()) == 1
    assert "GPU speed" in (out / "benchmark_speed.md").read_text()
    finetune = command("finetune", Setting("before", 256, ()), args, tmp_path)
    assert finetune[1:3] == ["-m", "patchplace.pipelines.finetune"]
    assert not any(a.startswith("objective.") for a in finetune)


def test_profile_suite_names_where_each_step_goes_and_its_share_outside_compute(tmp_path):
    """torch.profiler over tiny steps: per objective the top operators by self time (shares of one total, largest
    first, matrix products counted as compute) and a closing row with the step's share outside compute."""
    from patchplace.research.benchmarks.profile import is_compute

    assert benchmark.main(["--suite", "profile", "--preset", "vit_micro", "--batch", "4", "--repeats", "2",
                           "--warmup", "1", "--objectives", "supervised", "mae", "--profile-top", "15", "--out",
                           str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "benchmark_profile.json").read_text())["results"]
    for name in ("profile/supervised", "profile/mae"):
        ops = [r for r in rows if r["name"] == name and r["op"] != "(all)"]
        total = next(r for r in rows if r["name"] == name and r["op"] == "(all)")
        # (15: on a tiny model a loaded machine's dispatch overhead can push the small matmuls out of a top 5)
        assert len(ops) == 15 and [r["share"] for r in ops] == sorted((r["share"] for r in ops), reverse=True)
        assert 0 < sum(r["share"] for r in ops) <= 1.0001 and 0 < total["non_compute_share"] < 1
        assert any(r["compute"] for r in ops) and total["ms_per_step"] >= sum(r["ms_per_step"] for r in ops) - 0.01
    assert is_compute("aten::addmm") and is_compute("aten::_scaled_dot_product_efficient_attention")
    assert not is_compute("aten::copy_") and not is_compute("aten::native_layer_norm")
    assert "outside compute" in (tmp_path / "benchmark_profile.md").read_text()


def test_update_keeps_what_this_run_did_not_measure(tmp_path):
    """--update: benchmark.json keeps the other suites' rows and seconds; a suite's own file (the speed ladder,
    measured a few methods per GPU call) keeps the other methods' rows and replaces the measured ones."""
    shared = tmp_path / "benchmark.json"
    shared.write_text(json.dumps({"meta": {"seconds": {"masks": 2.0, "total": 2.0}}, "results": [
        {"suite": "masks", "name": "m"}, {"suite": "data", "name": "old"}]}))
    rows, meta = benchmark.updated(shared, [{"suite": "data", "name": "new"}],
                                   {"suite": "data", "seconds": {"total": 3.0}})
    assert [r["name"] for r in rows] == ["m", "new"] and meta["seconds"] == {"masks": 2.0, "data": 3.0, "total": 5.0}
    own = tmp_path / "benchmark_speed.json"
    own.write_text(json.dumps({"meta": {"suite": "speed"}, "results": [
        {"name": "speed/mae", "setting": "before", "images_per_s": 1.0},
        {"name": "speed/mp3", "setting": "before", "images_per_s": 2.0}]}))
    rows, meta = benchmark.updated(own, [{"name": "speed/mp3", "setting": "before", "images_per_s": 9.0}],
                                   {"suite": "speed"})
    assert [(r["name"], r["images_per_s"]) for r in rows] == [("speed/mae", 1.0), ("speed/mp3", 9.0)]
    assert list(meta["updated"]) == ["speed/mp3"]
    own.write_text(json.dumps({"meta": {"suite": "speed", "seconds": {"total": 5.0}}, "results": rows}))
    _, meta = benchmark.updated(own, [{"name": "speed/mae", "images_per_s": 3.0}],
                                {"suite": "speed", "seconds": {"total": 2.0}})
    assert meta["seconds"] == {"earlier calls": 5.0, "speed/mae": 2.0, "total": 7.0}, "each call's seconds, summed"
    assert benchmark.updated(tmp_path / "none.json", [{"name": "x"}], {"suite": "speed"}) == ([{"name": "x"}],
                                                                                              {"suite": "speed"})


# ------------------------------------------------------------------------------ the measuring functions
def micro(**overrides):
    """A seeded 2-layer, 32-wide ViT on 16 x 16 images with patch 4 (16 positions)."""
    torch.manual_seed(overrides.pop("seed", 0))
    return create_model("vit_micro", **{"img_size": 16, "patch_size": 4, "in_chans": 1, **overrides})


def test_flop_model_on_the_study_vit():
    built = {name: build() for name, build in default_objectives("vit_cpu_narrow").items()}
    base = train_flops(built["supervised"], 16)
    ratio = {name: train_flops(obj, 16) / base for name, obj in built.items()}
    # Only K/V and attention shrink under MP3, so its ratio falls with eta but stays above the MLP + Q/out share.
    assert 0.75 < ratio["mp3_eta0.75"] < ratio["mp3_eta0.5"] < ratio["mp3_eta0"]
    assert ratio["mp3_eta0"] == pytest.approx(1.0, abs=0.01)  # the same tokens; a D -> N head for the classifier
    assert ratio["mae"] < ratio["droppos"] < 1.0  # DropPos adds the no-grad full-image reference forward
    assert ratio["mjp"] > 1.0  # + the DAL regressor
    # StoP is I-JEPA's step on masks of its own draw (its noise is drawn first): the same sizes on average
    assert ratio["stop"] == pytest.approx(ratio["ijepa"], rel=0.03) and ratio["randsac"] > 1.0
    assert ratio["stop_noema"] == ratio["stop"]  # the EMA update is no matrix product
    assert built["ijepa"].config.predictor_dim == 96 and built["mae"].config.decoder_dim == 128  # study configs


def test_flops_are_counted_on_the_step_and_match_the_closed_form_of_the_supervised_vit():
    built = {name: build() for name, build in default_objectives().items()}
    sup = built["supervised"]
    bb, c = sup.backbone, sup.backbone.config
    n, d = bb.num_patches, c.embed_dim
    forward = c.depth * block_flops(n + 1, n + 1, d, c.mlp_ratio) + 2 * d * c.num_classes
    patch = 2 * n * c.patch_size**2 * c.in_chans * d  # its input needs no gradient: forward + weight gradient
    base = train_flops(sup, 4)
    assert base == pytest.approx(3 * forward + 2 * patch, rel=0.02)  # sdpa's backward is counted at 2.5x
    # Only K/V and attention shrink under MP3 (N = 64 + the class token, D = 192): ~0.84 of the supervised step at
    # eta = 0.75, the class token a query and always a key (§3.1).
    assert train_flops(built["mp3_eta0.75"], 4) / base == pytest.approx(0.843, abs=0.01)
    assert train_flops(built["mp3_eta0"], 4) > base  # the same N + 1 tokens, and its D -> N head on N tokens
    # docs/design.md: only K/V and attention shrink, so eta = 0.75 at N = 64, D = 192 bounds a block's ratio at ~0.84.
    assert block_flops(64, 16, 192) / block_flops(64, 64, 192) == pytest.approx(0.842, abs=1e-3)
    # counting leaves the caller's RNG and the gradients as they were
    state = torch.get_rng_state()
    train_flops(built["ijepa"], 2)
    assert torch.equal(state, torch.get_rng_state()) and all(p.grad is None for p in built["ijepa"].parameters())


def test_step_rows_report_throughput_ratios_and_the_fraction_of_peak():
    builders = {"supervised": lambda: Supervised(micro(num_classes=10)),
                "mp3": lambda: MP3(micro(pos_embed="none"), MP3Config(eta=0.5))}
    rows = step_times(builders, batch=4, repeats=1, warmup=0, peak_gflops=100.0)
    assert [r["name"] for r in rows] == ["pretrain_step/supervised", "pretrain_step/mp3"]
    assert rows[0]["time_vs_supervised"] == 1.0 and rows[1]["flop_ratio"] < 1.0
    for row in rows:
        assert row["samples_per_s"] > 0 and row["achieved_gflops"] > 0
        assert row["peak_fraction"] == pytest.approx(row["achieved_gflops"] / 100.0, abs=1e-3)


def test_memory_probe_mask_timer_attention_block_and_matmul_peak_return_positive_numbers():
    row = step_memory("mp3_eta0.75", preset="vit_micro", batch=2, steps=1)
    assert row["peak_rss_mb"] >= row["rss_before_mb"] > 0 and row["step_rss_mb"] >= 0
    rows = mask_times((8, 8), 4, repeats=1)
    assert [r["name"].split("/")[1] for r in rows] == ["ijepa_multiblock", "mjp_blockwise_0.15"]
    assert all(r["ms"] > 0 for r in rows)
    row = context_attention(batch=2, num_tokens=16, dim=32, num_heads=2, repeats=1, warmup=0)
    assert row["context_tokens"] == 4 and row["full_ms"] > 0 and row["context_ms"] > 0
    row = matmul_peak(size=64, repeats=2, warmup=0)
    assert row["gflops"] >= row["median_gflops"] > 0 and row["size"] == 64 and row["device"] == "cpu"


def test_shard_read_throughput_reads_the_whole_split(shards):
    row = shard_read_throughput(shards / "img" / "train", num_workers=0, batch_size=5, pad_to=32)
    assert row["samples"] == 64 and row["samples_per_s"] > 0


def test_saved_bytes_count_what_backward_keeps():
    """The measure sees precision and kernels: fp32 saves more than bf16 autocast, the materialised softmax more
    than the fused kernel (its N x N probabilities), and a batch of 2 saves twice the activations of 1."""
    model = Supervised(micro(num_classes=10))
    bf16 = saved_bytes_per_sample(model)
    assert saved_bytes_per_sample(model, amp="no") > 1.5 * bf16 > 0
    assert saved_bytes_per_sample(model, kernel="math") > bf16
    one, two, three = (saved_bytes(model, b) for b in (1, 2, 3))
    assert two - one == three - two > 0, "activations grow linearly with the batch"


@pytest.mark.slow
def test_mp3_saves_less_than_supervised_at_vit_b_on_both_kernels():
    """MP3 Table 2's memory claim, device-independent (bytes saved for backward per sample, ViT-B/16 at 224 px,
    GPU autocast dtypes): at eta 0.75 MP3 keeps <= 0.95x the supervised step's activations with the fused kernel
    and <= 0.72x (the paper's ratio) with the materialised softmax of the paper's time; less the higher eta."""
    rows = saved_bytes_table("vit_base", etas=(0.5, 0.75))
    ratio = {(r["kernel"], r["eta"]): r["vs_supervised"] for r in rows}
    assert ratio[("sdpa", 0.75)] <= 0.95 and ratio[("math", 0.75)] <= 0.72, ratio
    assert ratio[("sdpa", 0.75)] < ratio[("sdpa", 0.5)] < 1.0 and ratio[("math", 0.75)] < ratio[("math", 0.5)]


# ---------------------------------------------------------------------------------------------- the gpu suite
def test_the_gpu_suite_refuses_without_cuda_in_one_line(tmp_path, monkeypatch, capsys):
    """Through the script's entry (pipelines/benchmark.py calls research.cli's main and exits with what it raises),
    in this process: no CUDA device is the same answer as a hidden one."""
    from patchplace.research.cli import main as script_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as refused:
        script_main("benchmark", ["--suite", "gpu", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "no CUDA device" in err
    assert list(tmp_path.iterdir()) == []


def test_the_gpu_suite_plans_every_registered_method_eager_then_compiled():
    from patchplace.objectives import list_methods
    from patchplace.research.benchmarks.gpu import MODES, Row, plan_rows

    rows, methods = plan_rows(), {spec.name for spec in list_methods("image")}
    for mode in MODES:
        labels = [r.objective for r in rows if r.mode == mode]
        assert labels[0] == "supervised" and len(labels) == len(methods) and "mp3_eta0.75" in labels
        assert {label.partition("_eta")[0] for label in labels} == methods
    assert [r.mode for r in rows] == sorted((r.mode for r in rows), key=MODES.index), "every eager row first"
    assert plan_rows(["mae"], ("eager",)) == [Row("supervised", "eager"), Row("mae", "eager")]
    assert Row("mae", "compile").name == "gpu_step/mae+compile"
    with pytest.raises(SystemExit, match="unknown"):
        plan_rows(["mp3"])


def test_the_gpu_suite_writes_each_row_as_it_lands_skips_past_its_budget_and_resumes(tmp_path, monkeypatch):
    """The suite's bookkeeping on a stand-in device (a fake row runner and clock): rows written one by one, those
    that would start past the budget skipped with a note, a second call measuring only what is missing, ratios
    to the supervised row of the same mode."""
    from types import SimpleNamespace

    from patchplace.research.benchmarks import gpu

    clock, calls, landed = [0.0], [], []
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu.torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(gpu, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(gpu, "peak_of", lambda args, state: state.setdefault(
        "matmul_peak", {"name": "matmul_peak/bfloat16/8192", "gflops": 600_000.0}))

    def run_row(row, spec, seconds):
        if landed:  # every row measured so far is on disk before the next one starts
            on_disk = json.loads((tmp_path / gpu.FILE).read_text())["results"]
            assert set(landed) <= {r["name"] for r in on_disk if "step_ms" in r}
        calls.append(row.name)
        landed.append(row.name)
        clock[0] += 40
        ms = {"supervised": 100.0, "mae": 66.0}[row.objective] * (0.5 if row.mode == "compile" else 1.0)
        tflops = {"supervised": 6.0, "mae": 3.3}[row.objective]
        return {"step_ms": ms, "flops_per_step": int(tflops * 1e12), "tflops_per_step": tflops,
                "achieved_tflops": round(tflops / ms * 1e3, 1),
                "cuda_peak_mb": 100 * ms, "gpu_busy_ms": 0.9 * ms}

    monkeypatch.setattr(gpu, "run_row", run_row)
    argv = ["--suite", "gpu", "--objectives", "mae", "--gpu-row-seconds", "60", "--gpu-compile-seconds", "60",
            "--out", str(tmp_path)]
    assert benchmark.main([*argv, "--gpu-budget", "100"]) == 0
    assert calls == ["gpu_step/supervised", "gpu_step/mae"]
    rows = {r["name"]: r for r in json.loads((tmp_path / gpu.FILE).read_text())["results"]}
    assert "skipped" in rows["gpu_step/supervised+compile"]["note"] and "step_ms" not in rows["gpu_step/mae+compile"]
    mae = rows["gpu_step/mae"]
    assert (mae["time_vs_supervised"], mae["flop_ratio"], mae["memory_vs_supervised"]) == (0.66, 0.55, 0.66)
    assert mae["time_per_flop"] == 1.2 and mae["tracks_flops"] is False and mae["paper_time_ratio"] == 0.7
    assert rows["gpu_step/supervised"]["of_peak"] == round(60.0 / 600.0, 3)
    calls.clear()
    assert benchmark.main([*argv, "--gpu-budget", "1000"]) == 0
    assert calls == ["gpu_step/supervised+compile", "gpu_step/mae+compile"], "the rows measured before are kept"
    data = json.loads((tmp_path / gpu.FILE).read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert len(rows) == 4 and all("step_ms" in r for r in rows.values())
    assert rows["gpu_step/mae+compile"]["time_vs_supervised"] == 0.66 and data["meta"]["suite"] == "gpu"
    assert "Stand-in GPU" in (tmp_path / "benchmark_gpu.md").read_text()


def test_a_gpu_row_measures_time_memory_flops_and_host_work_in_its_process():
    """:func:`gpu.measure` on the CPU at toy size (on a GPU the same row adds its busy time and peak memory)."""
    from patchplace.research.benchmarks import gpu

    spec = dict(preset="vit_micro", img_size=32, batch=2, warmup=1, repeats=1, profile_steps=1, attention="sdpa",
                device="cpu", backend="eager")
    eager = gpu.measure({**spec, "objective": "mp3_eta0.75", "mode": "eager"})
    assert eager["step_ms"] > 0 and eager["flops_per_step"] > 0 and eager["aten_ops"] > 100
    assert eager["host_syncs"] == 0 and eager["gpu_busy_ms"] is None and "recompiles" not in eager
    compiled = gpu.measure({**spec, "objective": "supervised", "mode": "compile"})
    assert compiled["recompiles"] == 0 and compiled["graphs"] >= 1 and "aten_ops" not in compiled


def test_gpu_busy_time_is_the_union_of_the_device_intervals():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from patchplace.research.benchmarks.gpu import busy_us

    def event(start, end, device=DeviceType.CUDA):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event(0, 10), event(5, 12), event(20, 25), event(0, 100, DeviceType.CPU)]
    assert busy_us(events) == 17 and busy_us(events[-1:]) is None
