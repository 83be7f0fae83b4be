"""The onnxruntime-gpu wheel in parts for the lent GPU (research/gpu/gpu_parts.py, make gpu-ort-parts,
research/gpu/gpu_onnx.sh; docs/study.md "ONNX Runtime on CUDA, brought in parts"): split -> reassemble gives the same
bytes, a missing or damaged part stops the reassembly in one line naming it, a second split writes nothing; and the
evaluator's provider option on a tiny random model, forced to the CPU provider (parity and latency measured), refusing
CUDA where the session would not run on it. CPU only, a few seconds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from patchplace.export import ExportError, export_checkpoint
from patchplace.export.evaluate import check_provider
from patchplace.export.evaluate import main as ort_evaluate_main
from patchplace.export.exporter import ort
from patchplace.models import create_model, save_pretrained

ROOT = Path(__file__).resolve().parents[1]
# research/gpu/gpu_parts.py is a standalone script (the lent machine's bare python3 runs it): loaded by its path
_spec = importlib.util.spec_from_file_location("gpu_parts", ROOT / "research" / "gpu" / "gpu_parts.py")
gpu_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_parts)

KIB = 1024


@pytest.fixture
def wheel(tmp_path) -> Path:
    """A 3 MiB + 123 bytes random file standing in for the wheel."""
    path = tmp_path / "src" / "onnxruntime_gpu-9.9.9-cp312-cp312-manylinux_2_28_x86_64.whl"
    path.parent.mkdir()
    path.write_bytes(np.random.default_rng(0).bytes(3 * 2**20 + 123))
    return path


def split_cli(wheel: Path, out: Path, max_kib: int = 700) -> int:
    return gpu_parts.main(["split", str(wheel), "--out", str(out), "--max-mib", str(max_kib / 1024)])


def test_split_then_reassemble_gives_the_same_bytes(wheel, tmp_path):
    out = tmp_path / ".ort"
    manifest = gpu_parts.split(wheel, out, 700 * KIB)
    assert [p["dir"] for p in manifest["parts"]] == ["p0", "p1", "p2", "p3", "p4"]
    assert all(p["size"] <= 700 * KIB for p in manifest["parts"]) and sum(p["size"] for p in manifest["parts"]) == \
        wheel.stat().st_size
    for part in manifest["parts"]:  # each part alone in its directory, with the whole manifest beside it
        assert sorted(f.name for f in (out / part["dir"]).iterdir()) == sorted([part["name"], "MANIFEST.json"])
        assert json.loads((out / part["dir"] / "MANIFEST.json").read_text()) == manifest
    assert manifest["file"] == wheel.name and manifest["sha256"] == gpu_parts.sha256_of(wheel)
    rebuilt = gpu_parts.reassemble(out, tmp_path / "whl")
    assert rebuilt.name == wheel.name and rebuilt.read_bytes() == wheel.read_bytes()
    assert gpu_parts.main(["status", "--parts", str(out), "--verify", "--strict"]) == 0


@pytest.mark.parametrize("harm", ["missing", "damaged"])
def test_a_missing_or_damaged_part_stops_the_reassembly_in_one_line(wheel, tmp_path, capsys, harm):
    out = tmp_path / ".ort"
    assert split_cli(wheel, out) == 0
    capsys.readouterr()
    part = out / "p2" / f"{wheel.name}.part2"
    if harm == "missing":
        part.unlink()
    else:
        data = bytearray(part.read_bytes())
        data[1000] ^= 0xFF  # same size, other bytes: only the sha256 sees it
        part.write_bytes(bytes(data))
    assert gpu_parts.main(["reassemble", "--parts", str(out), "--out", str(tmp_path / "whl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert f"p2 {harm}" in err and f"carry {out.as_posix()}/p2 in the next call" in err
    assert not (tmp_path / "whl" / wheel.name).exists()
    assert gpu_parts.main(["status", "--parts", str(out), "--verify", "--strict"]) == 1  # status names it next
    assert f"next: carry {out.as_posix()}/p2" in capsys.readouterr().out
    assert gpu_parts.main(["status", "--parts", str(out)]) == 0  # a device call's progress line is no failure


def test_without_the_first_part_the_others_still_say_what_is_missing(wheel, tmp_path):
    out = tmp_path / ".ort"
    gpu_parts.split(wheel, out, 700 * KIB)
    for gone in ("p0", "p3"):
        for f in (out / gone).iterdir():
            f.unlink()
        (out / gone).rmdir()
    with pytest.raises(gpu_parts.PartsError, match=r"3 of 5 parts intact; p0, p3 missing: carry .*/p0, .*/p3 in the "
                                                   r"next calls \(one per call\)"):
        gpu_parts.reassemble(out, tmp_path / "whl")
    with pytest.raises(gpu_parts.PartsError, match=r"no MANIFEST\.json"):
        gpu_parts.reassemble(tmp_path / "nothing", tmp_path / "whl")


def test_splitting_and_reassembling_again_write_nothing(wheel, tmp_path, capsys):
    out = tmp_path / ".ort"
    assert split_cli(wheel, out) == 0
    stamps = {f: f.stat().st_mtime_ns for f in out.rglob("*")}
    assert split_cli(wheel, out) == 0
    assert "already split, nothing to do" in capsys.readouterr().out
    assert {f: f.stat().st_mtime_ns for f in out.rglob("*")} == stamps
    first = gpu_parts.reassemble(out, tmp_path / "whl")
    stamp = first.stat().st_mtime_ns
    assert gpu_parts.reassemble(out, tmp_path / "whl").stat().st_mtime_ns == stamp
    # another size: split again, and the part directories it no longer uses are gone
    assert split_cli(wheel, out, max_kib=2048) == 0
    assert [d.name for d in gpu_parts.part_dirs(out)] == ["p0", "p1"]
    assert gpu_parts.reassemble(out, tmp_path / "whl2").read_bytes() == wheel.read_bytes()


def test_the_device_script_documents_every_option():
    done = subprocess.run(["bash", str(ROOT / "research" / "gpu" / "gpu_onnx.sh"), "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=30)
    assert done.returncode == 0
    for option in ("--prepare", "--provider", "--checkpoint", "--onnx", "--epochs", "--run", "--limit", "--repeats"):
        assert option in done.stdout
    help_text = subprocess.run([sys.executable, str(ROOT / "research" / "gpu" / "gpu_parts.py"), "reassemble",
                                "--help"],
                               capture_output=True, text=True, timeout=30).stdout
    assert "--parts" in help_text and "--out" in help_text


# ---------------------------------------------------------------------------------------------- the evaluator
@pytest.fixture(scope="module")
def tiny(shards, tmp_path_factory):
    """A random 3-class 32 px classifier (exported) beside the toy test split (32 Fashion-MNIST-shaped images)."""
    root = tmp_path_factory.mktemp("provider")
    (root / "shards").symlink_to(shards / "img")
    torch.manual_seed(0)
    model = create_model("vit_micro", img_size=32, in_chans=1, num_classes=3).eval()
    save_pretrained(model, root / "checkpoint",
                    metadata={"classes": ["a", "b", "c"], "normalization": {"mean": [0.5], "std": [0.25]},
                              "pad_to": 32})
    export_checkpoint(root / "checkpoint", root / "model.onnx")
    return root


def evaluate_args(root: Path, out: Path, provider: str) -> list[str]:
    return [str(root / "model.onnx"), "--data", str(root / "shards" / "test"), "--out", str(out), "--provider",
            provider, "--checkpoint", str(root / "checkpoint"), "--robustness-limit", "0", "--consistency-limit", "8",
            "--latency-batches", "1", "4", "--latency-repeats", "3", "--latency-warmup", "1", "--batch-size", "8"]


def test_the_cpu_provider_measures_parity_top1_and_latency(tiny, tmp_path):
    assert ort_evaluate_main(evaluate_args(tiny, tmp_path, "cpu")) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["providers"][0] == "CPUExecutionProvider"
    env = results["environment"]
    assert env["provider"] == "CPUExecutionProvider" and env["device"] == "cpu"
    assert env["onnxruntime"] == ort.__version__ and env["torch"] == torch.__version__ and env["hardware"]
    parity = results["parity"]
    assert parity["count"] == 32 and parity["max_abs_logit_diff"] < 1e-4 and parity["argmax_agreement"] == 1.0
    assert parity["onnxruntime_top1"] == parity["pytorch_top1"] == results["accuracy"]["top1"]
    assert set(results["latency"]) == {"onnxruntime/batch1", "onnxruntime/batch4", "pytorch/batch1",
                                       "pytorch/batch4"}
    for timing in results["latency"].values():
        assert timing["p95_ms"] >= timing["p50_ms"] > 0 and timing["images_per_s"] > 0
    text = (tmp_path / "results.md").read_text()
    assert "Parity with PyTorch eager" in text and "hardware: " in text and "speed-up vs PyTorch" in text


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available(),
                    reason="CUDA is usable here: the refusal is for machines where it is not")
def test_asking_for_cuda_where_it_cannot_run_fails_in_one_line(tiny, tmp_path, capsys):
    assert ort_evaluate_main(evaluate_args(tiny, tmp_path, "cuda")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: CUDAExecutionProvider not active: ")
    assert not (tmp_path / "results.json").exists()


def test_a_session_that_fell_back_to_the_cpu_is_refused():
    """ONNX Runtime drops to the CPU without an error when the CUDA libraries do not load: the session says so."""

    class FellBack:
        def get_providers(self):
            return ["CPUExecutionProvider"]

    with pytest.raises(ExportError, match="CUDAExecutionProvider not active: the session runs on "
                                          "CPUExecutionProvider") as caught:
        check_provider(FellBack(), "cuda")
    assert "\n" not in str(caught.value)
    check_provider(FellBack(), "cpu")
    check_provider(FellBack(), "auto")


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available provider names")
def test_a_cuda_session_that_silently_falls_back_to_the_cpu_is_refused(tiny, tmp_path, monkeypatch, capsys):
    """As on a machine with onnxruntime-gpu and a GPU whose CUDA libraries do not load: ONNX Runtime is told CUDA is
    there, the session it makes runs on the CPU all the same, and the evaluation stops in one line before any work."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ort_evaluate_main(evaluate_args(tiny, tmp_path, "cuda")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: CUDAExecutionProvider not active: the session runs on "
                                               "CPUExecutionProvider (")
    assert "LD_LIBRARY_PATH" in err[0] and not (tmp_path / "results.json").exists()


def test_no_part_is_larger_than_a_call_carries():
    """make gpu-ort-parts: parts of at most 52 MiB, so a part + the tracked tree stays under 64 MiB a call."""
    makefile = (ROOT / "Makefile").read_text()
    assert "ORT_PART_MIB    ?= 52" in makefile and "gpu-ort-parts" in makefile.split("\n.PHONY:")[1].split("\n\n")[0]
    assert "/.ort/" in (ROOT / ".gitignore").read_text().splitlines()
