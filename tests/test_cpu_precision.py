"""The precision a run trains in on a CPU: ``run.mixed_precision=auto`` detects bf16 units and adopts bf16 only
where its rules say (engine/hardware.py), records what it chose; the emulated bf16 matmuls of the equivalence test
compute what a bf16 unit with float32 accumulation computes; the equivalence decision is a TOST. CPU-agnostic:
nothing here depends on the CPU the test runs on (the detection is given its CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from pipeline_args import TINY, img

from patchplace.pipelines import CONFIGS, pretrain
from patchplace.pipelines import config as pipeline_config
from patchplace.pipelines.engine import hardware
from patchplace.pipelines.engine.hardware import CpuInfo, precision_line, resolve_precision
from patchplace.pipelines.stages import stage_precision
from patchplace.research.benchmarks import cpu_speed, equivalence
from patchplace.research.emulated_bf16 import EmulatedBF16Matmuls

AVX2 = CpuInfo("AVX2 CPU", ("avx2", "fma"), None, False)
AVX512_BF16 = CpuInfo("AVX-512 bf16 CPU", ("avx512_bf16", "avx512f", "avx2"), "avx512_bf16", True)
AMX = CpuInfo("AMX CPU", ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"), "amx", True)


@pytest.fixture
def on_cpu(monkeypatch):
    """resolve_precision on a given CPU, with the equivalence verdict given."""
    def use(cpu: CpuInfo, equivalent: bool = True) -> None:
        monkeypatch.setattr(hardware, "cpu_info", lambda: cpu)
        monkeypatch.setattr(hardware, "CPU_BF16_EQUIVALENT", equivalent)
    return use


@pytest.mark.parametrize(("cpu", "equivalent", "expected"), [
    (AVX2, True, "no"), (AVX512_BF16, True, "no"), (AMX, True, "bf16"), (AMX, False, "no")])
def test_auto_trains_bf16_only_on_amx_and_only_once_bf16_passed_its_equivalence_test(on_cpu, cpu, equivalent,
                                                                                       expected):
    on_cpu(cpu, equivalent)
    chosen = resolve_precision("auto", "cpu")
    assert chosen.value == expected and chosen.asked == "auto"
    assert cpu.name in chosen.why
    line = precision_line(chosen)
    assert line.startswith("run.mixed_precision=auto: ") and "\n" not in line
    assert f"run.mixed_precision={'no' if expected == 'bf16' else 'bf16'}" in line  # how to force the other


@pytest.mark.parametrize("asked", ["no", "bf16"])  # fp16, a GPU precision, trains float32 on a CPU
def test_an_explicit_precision_is_never_overridden(on_cpu, asked):
    on_cpu(AVX2)
    assert resolve_precision(asked, "cpu").value == asked
    on_cpu(AMX)
    assert resolve_precision(asked, "cpu").value == asked


def test_the_detection_reads_the_cpu_flags(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_bf16 "
                    "amx_tile\n\nprocessor\t: 1\nmodel name\t: other\n")
    monkeypatch.setattr(hardware, "CPUINFO", info)
    hardware.cpu_info.cache_clear()
    try:
        cpu = hardware.cpu_info()
    finally:
        hardware.cpu_info.cache_clear()
    assert cpu.name == "Some Xeon" and cpu.bf16_units == "amx"
    assert cpu.flags == ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")


def test_auto_is_a_config_value_and_a_stage_runs_in_process_where_auto_means_float32(on_cpu, shards):
    cfg = pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "run.mixed_precision=auto"])
    assert cfg.run.mixed_precision == "auto"
    with pytest.raises(pipeline_config.ConfigError, match=r"one of no, fp16, bf16, auto, got .fast."):
        pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "run.mixed_precision=fast"])
    on_cpu(AVX2)
    assert stage_precision(["run.mixed_precision=auto"]) == "no"  # by_precision: in this process
    on_cpu(AMX)
    assert stage_precision(["run.mixed_precision=auto"]) == "bf16"  # a process of its own


def test_a_run_at_auto_prints_one_line_and_records_the_choice(on_cpu, shards, tmp_path, capsys):
    on_cpu(AVX2)
    assert pretrain.main(["method=supervised", *img(shards), *TINY, "optim.max_steps=2",
                          "run.mixed_precision=auto", f"run.output={tmp_path}"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run.mixed_precision=auto")]
    assert len(lines) == 1 and "AVX2 CPU" in lines[0] and "float32" in lines[0]
    metadata = json.loads((tmp_path / "checkpoint" / "config.json").read_text())["metadata"]
    assert metadata["compute"]["asked"] == "auto" and metadata["compute"]["value"] == "no"
    assert metadata["compute"]["cpu"]["name"] == "AVX2 CPU"


def test_emulated_bf16_matmuls_compute_from_bf16_inputs_with_float32_accumulation():
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(24, 40, generator=gen).bfloat16() for _ in range(2))
    b = b.T.contiguous()
    bias = torch.randn(24, generator=gen).bfloat16()
    reference = (a.float() @ b.float()).bfloat16()  # float32 accumulation, one rounding
    native = a @ b
    with EmulatedBF16Matmuls():
        emulated = a @ b
        emulated_addmm = torch.addmm(bias, a, b)
        emulated_bmm = torch.bmm(a[None], b[None])[0]
    assert emulated.dtype == torch.bfloat16 and torch.equal(emulated, reference)
    assert torch.equal(emulated_bmm, reference)
    assert torch.equal(emulated_addmm, (bias.float() + a.float() @ b.float()).bfloat16())
    # torch's own bf16 kernel: the same products, up to summation order (one bf16 rounding apart at most)
    assert torch.allclose(native.float(), emulated.float(), rtol=2 ** -7, atol=1e-2)


def test_emulated_bf16_reaches_the_backward_matmuls_and_leaves_float32_alone():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    seen = []

    class Counting(EmulatedBF16Matmuls):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}:
                seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return super().__torch_dispatch__(func, types, args, kwargs)

    with Counting():
        layer(x).sum().backward()  # float32: untouched
        plain = layer.weight.grad.clone()
        layer.weight.grad = None
        in_float32 = len(seen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out.float().sum().backward()
    assert in_float32 >= 2 and all(d == torch.float32 for dtypes in seen[:in_float32] for d in dtypes)
    # the forward matmul and the weight gradient's, in bf16
    assert len(seen) - in_float32 >= 2 and all(d == torch.bfloat16 for dtypes in seen[in_float32:] for d in dtypes)
    assert layer.weight.grad.dtype == torch.float32
    assert torch.allclose(layer.weight.grad, plain, atol=0.05)


def test_the_equivalence_decision_is_a_tost_against_the_stated_margin():
    fp32 = {0: 0.700, 1: 0.710, 2: 0.690}
    close = equivalence.tost({0: 0.702, 1: 0.709, 2: 0.692}, fp32)
    assert close["equivalent"] and close["ci90"][0] > -0.01 and close["ci90"][1] < 0.01
    far = equivalence.tost({0: 0.680, 1: 0.69, 2: 0.668}, fp32)
    assert not far["equivalent"]
    noisy = equivalence.tost({0: 0.72, 1: 0.695, 2: 0.69}, fp32)  # mean ~0 but a wide interval: not shown equal
    assert abs(noisy["mean_diff"]) < 0.01 and not noisy["equivalent"]


@pytest.mark.parametrize("method", ["mp3", "finetune"])
@pytest.mark.parametrize("rung", cpu_speed.RUNGS, ids=lambda r: r.name)
def test_every_ladder_command_is_a_valid_pipeline_command(method, rung, shards, tmp_path):
    argv = cpu_speed.command(method, cpu_speed.MODELS["vit_small"], rung, 3, shards / "img" / "train",
                             tmp_path / "out")
    module = argv[2]
    cls = pretrain.PretrainConfig if module.endswith("pretrain") else __import__(
        "patchplace.pipelines.finetune", fromlist=["FinetuneConfig"]).FinetuneConfig
    config = argv[argv.index("--config") + 1]
    assert config.startswith(str(CONFIGS))
    cfg = pipeline_config.load(cls, config, argv[argv.index("--config") + 2:])
    assert cfg.optim.max_steps == 3 and cfg.data.in_memory and cfg.model.preset == "vit_small"
    assert cfg.run.mixed_precision == ("bf16" if rung.bf16 else "no")


def test_the_study_names_a_bf16_precision_in_its_training_stages_and_float32_by_omission(on_cpu):
    from patchplace.research.reproduction.plan import RUNS, StudyConfig
    from patchplace.research.reproduction.runner import Study

    mp3 = next(r for r in RUNS if r.name == "mp3")

    def precision_args(**fields) -> list[str]:
        return [a for a in Study(StudyConfig(**fields)).common(mp3, 0) if a.startswith("run.mixed_precision")]

    on_cpu(AVX2)
    assert precision_args() == []  # float32: the stage's arguments as they always were
    assert precision_args(precision="bf16") == ["run.mixed_precision=bf16"]
    on_cpu(AMX)
    assert precision_args() == ["run.mixed_precision=bf16"]
    assert precision_args(precision="no") == []
    with pytest.raises(pipeline_config.ConfigError, match="precision must be auto, no or bf16"):
        StudyConfig(precision="fp16").validate()


@pytest.mark.slow
def test_the_equivalence_suite_trains_both_precisions_through_the_study_and_decides_by_tost(shards, tmp_path):
    """Tiny budget, two seeds: the study's stages in float32 and in bf16 (native on a CPU with bf16 units, else
    emulated), both numbers read on the validation split, a TOST row per measure."""
    from patchplace.research import benchmark

    runs, out = tmp_path / "runs", tmp_path / "out"
    assert benchmark.main([
        "--suite", "cpu_equivalence", "--equivalence-methods", "mp3", "--equivalence-seeds", "0", "1",
        "--equivalence-runs", str(runs), "--out", str(out), "--equivalence-study", f"fashion_mnist={shards / 'img'}",
        "preset=vit_micro", "pretrain_epochs=0.25", "finetune_epochs=0.25", "holdout=6", "probe_epochs=2",
        "batch_size=8"]) == 0
    rows = json.loads((out / "benchmark_cpu_equivalence.json").read_text())["results"]
    assert [r["measure"] for r in rows] == list(equivalence.MEASURES.values())
    for row in rows:
        assert set(row["fp32"]) == set(row["bf16"]) == {"0", "1"} and row["margin"] == equivalence.MARGIN
        assert row["equivalent"] == (row["ci90"][0] > -row["margin"] and row["ci90"][1] < row["margin"])
    for precision, value in (("fp32", "no"), ("bf16", "bf16")):
        card = json.loads((runs / precision / "seed0" / "mp3" / "pretrain" / "checkpoint" / "config.json").read_text())
        assert card["metadata"]["compute"]["value"] == value
        emulated = precision == "bf16" and not hardware.cpu_info().onednn_bf16
        assert card["metadata"]["compute"].get("dispatch_modes") == (["EmulatedBF16Matmuls"] if emulated else None)
        assert (runs / precision / "seed1" / "mp3" / "val" / "results.json").is_file()
