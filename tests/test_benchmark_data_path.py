"""The data-path benchmarks at toy sizes: the loader_vs_step suite end to end (JSON + markdown table, the loader as
the pipelines build it from the DeiT config, both JPEG decoders, the step beside it) and the data_writer suite's
decoder rows (the reader before / after the fast JPEG path, pixel-identical); no timing assertions."""

from __future__ import annotations

import json

from patchplace.research import benchmark
from patchplace.research.benchmarks.data_writer import decoder_throughput, write_jpegs
from patchplace.research.benchmarks.loader_vs_step import compared


def test_loader_vs_step_suite_writes_its_rows_and_table(tmp_path):
    assert benchmark.main(["--suite", "loader_vs_step", "--loader-images", "12", "--loader-workers", "0", "1",
                           "--loader-step-batch", "4", "--step-preset", "vit_micro", "--step-repeats", "1",
                           "--loader-repeats", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "benchmark.json").read_text())["results"]
    step, loaders = rows[0], rows[1:]
    assert step["name"] == "step/vit_micro/supervised" and step["step_images_per_s"] > 0
    assert [(r["decoder"], r["workers"]) for r in loaders] == [("pillow", 0), ("fast", 0), ("pillow", 1),
                                                                 ("fast", 1)]
    for r in loaders:
        assert r["images"] == 12 and r["config"] == "imagenet_supervised_deitb_train" and r["pin_memory"] is False
        assert r["epochs"] == 2
        assert r["ratio"] == round(r["loader_images_per_s"] / step["step_images_per_s"], 2)
    markdown = (tmp_path / "benchmark.md").read_text()
    assert "Streaming loader (ImageNet recipe, 224 px) vs the training step" in markdown
    assert "| fast/workers=1 | fast | 1 |" in markdown


def test_compared_names_the_ratio_and_the_workers_a_step_needs():
    step = {"preset": "vit_base", "step_images_per_s": 1000.0}
    loaders = [{"decoder": "fast", "workers": w, "loader_images_per_s": rate} for w, rate in ((1, 150.0), (2, 280.0))]
    rows = compared(loaders, step)
    assert [r["ratio"] for r in rows] == [0.15, 0.28] and not any(r["keeps_up"] for r in rows)
    assert {r["workers_needed"] for r in rows} == {7}  # 1000 / 150 per worker, rounded up
    assert compared([{"decoder": "pillow", "workers": 0, "loader_images_per_s": 9.0}],
                    {"preset": "p", "step_images_per_s": 3.0})[0]["workers_needed"] is None  # no 1-worker row


def test_decoder_rows_time_the_reader_before_and_after_with_identical_pixels(tmp_path):
    rows = {r["name"]: r for r in decoder_throughput(write_jpegs(tmp_path, 10), repeats=1)}
    assert list(rows) == ["decode/pil", "decode/torchvision", "decode/project/before (Pillow)",
                          "decode/project/after (decode_jpeg where exact)"]
    for r in rows.values():
        assert r["max_abs_diff"] == 0 and r["identical_images"] == "10/10" and r["images_per_s_per_core"] > 0
    assert "vs_pil" in rows["decode/torchvision"] and "vs_pil" in rows["decode/project/after (decode_jpeg where exact)"]
