"""Benchmark helpers (no timing assertions): the batched mask generators' invariants, the FLOP model's ratios, step
timing rows and the memory probe."""

from __future__ import annotations

import pytest
import torch

from patchplace.objectives import ObjectiveError
from patchplace.objectives.benchmark import default_objectives, mask_times, step_memory, step_times, train_flops
from patchplace.objectives.block_masks import blockwise_masks, multiblock_masks


@pytest.mark.parametrize(("grid", "ratio"), [((8, 8), 0.15), ((14, 14), 0.03), ((14, 14), 0.27), ((7, 9), 0.5)])
def test_blockwise_masks_are_deterministic_and_never_exceed_the_ratio(grid, ratio):
    for seed in range(5):
        first = blockwise_masks(32, grid, ratio, generator=torch.Generator().manual_seed(seed))
        again = blockwise_masks(32, grid, ratio, generator=torch.Generator().manual_seed(seed))
        assert first.dtype == torch.bool and torch.equal(first, again)
        assert int(first.sum(1).max()) <= round(ratio * grid[0] * grid[1])
    assert blockwise_masks(0, (8, 8), 0.15).shape == (0, 64)


def _is_rectangle(index: torch.Tensor, grid: tuple[int, int]) -> bool:
    rows, cols = index // grid[1], index % grid[1]
    h, w = int(rows.max() - rows.min()) + 1, int(cols.max() - cols.min()) + 1
    return h * w == len(index)


@pytest.mark.parametrize(("batch", "grid"), [(128, (8, 8)), (8, (14, 14))])
def test_batched_multiblock_masks_keep_the_loop_invariants(batch, grid):
    n = grid[0] * grid[1]
    for make in (multiblock_masks,):
        masks = make(batch, grid, generator=torch.Generator().manual_seed(0))
        assert masks.targets.shape[:2] == (batch, 4) and masks.context.shape[0] == batch
        assert masks.context.shape[1] >= 4 and int(masks.context.max()) < n
        for b in range(batch):
            ctx, targets = masks.context[b], masks.targets[b]
            assert (ctx.diff() > 0).all() and (targets.diff(dim=-1) > 0).all(), "ascending raster order"
            assert not set(ctx.tolist()) & set(targets.reshape(-1).tolist())
            assert all(_is_rectangle(t, grid) for t in targets)
    first, again = (multiblock_masks(batch, grid, generator=torch.Generator().manual_seed(0)) for _ in range(2))
    assert torch.equal(first.context, again.context) and torch.equal(first.targets, again.targets)


def test_batched_multiblock_masks_redraw_small_contexts_and_fail_clearly():
    # min_keep 30 of 64 rejects many draws: every sample must still end up with >= 30 context patches.
    masks = multiblock_masks(64, (8, 8), num_targets=2, min_keep=30, generator=torch.Generator().manual_seed(0))
    assert masks.context.shape[1] >= 30
    with pytest.raises(ObjectiveError, match="could not leave"):
        multiblock_masks(4, (4, 4), num_targets=4, target_scale=(0.5, 0.5), min_keep=12,
                         generator=torch.Generator().manual_seed(0))


def test_flop_model_on_the_study_vit():
    built = {name: build() for name, build in default_objectives("vit_cpu_narrow").items()}
    base = train_flops(built["supervised"], 128)
    ratio = {name: train_flops(obj, 128) / base for name, obj in built.items()}
    # Only K/V and attention shrink under MP3, so its ratio falls with eta but stays above the MLP + Q/out share.
    assert 0.75 < ratio["mp3_eta0.75"] < ratio["mp3_eta0.5"] < ratio["mp3_eta0"]
    assert ratio["mp3_eta0"] == pytest.approx(1.0, abs=0.01)  # the same tokens; a D -> N head for the classifier
    assert ratio["mae"] < ratio["droppos"] < 1.0  # DropPos adds the no-grad full-image reference forward
    assert ratio["mjp"] > 1.0  # + the DAL regressor
    assert ratio["stop"] == ratio["ijepa"] and ratio["randsac"] > 1.0
    assert built["ijepa"].config.predictor_dim == 96 and built["mae"].config.decoder_dim == 128  # study configs


def test_step_rows_report_throughput_and_the_fraction_of_peak(micro):
    from patchplace.objectives import MP3, MP3Config, Supervised

    builders = {"supervised": lambda: Supervised(micro(num_classes=10)),
                "mp3": lambda: MP3(micro(pos_embed="none"), MP3Config(eta=0.5))}
    rows = step_times(builders, batch=4, repeats=1, warmup=0, peak_gflops=100.0)
    for row in rows:
        assert row["samples_per_s"] > 0 and row["achieved_gflops"] > 0
        assert row["peak_fraction"] == pytest.approx(row["achieved_gflops"] / 100.0, abs=1e-3)


def test_memory_probe_and_mask_timer_return_positive_numbers():
    row = step_memory("mp3_eta0.75", preset="vit_micro", batch=2, steps=1)
    assert row["peak_rss_mb"] >= row["rss_before_mb"] > 0 and row["step_rss_mb"] >= 0
    rows = mask_times((8, 8), 4, repeats=1)
    assert [r["name"].split("/")[1] for r in rows] == ["ijepa_multiblock", "mjp_blockwise_0.15"]
    assert all(r["ms"] > 0 for r in rows)


def test_saved_bytes_count_what_backward_keeps(micro):
    """The measure sees precision and kernels: fp32 saves more than bf16 autocast, the materialised softmax more
    than the fused kernel (its N x N probabilities), and a batch of 2 saves twice the activations of 1."""
    from patchplace.objectives import Supervised
    from patchplace.objectives.benchmark import saved_bytes, saved_bytes_per_sample

    model = Supervised(micro(num_classes=10))
    bf16 = saved_bytes_per_sample(model)
    assert saved_bytes_per_sample(model, amp="no") > 1.5 * bf16 > 0
    assert saved_bytes_per_sample(model, kernel="math") > bf16
    one, two, three = (saved_bytes(model, b) for b in (1, 2, 3))
    assert two - one == three - two > 0, "activations grow linearly with the batch"


def test_mp3_saves_less_than_supervised_at_vit_b_on_both_kernels():
    """MP3 Table 2's memory claim, device-independent (bytes saved for backward per sample, ViT-B/16 at 224 px,
    GPU autocast dtypes): at eta 0.75 MP3 keeps <= 0.95x the supervised step's activations with the fused kernel
    and <= 0.72x (the paper's ratio) with the materialised softmax of the paper's time; less the higher eta."""
    from patchplace.objectives.benchmark import saved_bytes_table

    rows = saved_bytes_table("vit_base", etas=(0.5, 0.75))
    ratio = {(r["kernel"], r["eta"]): r["vs_supervised"] for r in rows}
    assert ratio[("sdpa", 0.75)] <= 0.95 and ratio[("math", 0.75)] <= 0.72, ratio
    assert ratio[("sdpa", 0.75)] < ratio[("sdpa", 0.5)] < 1.0 and ratio[("math", 0.75)] < ratio[("math", 0.5)]
