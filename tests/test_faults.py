"""Runs that survive faults: kills at every line of the checkpoint protocol and at random points of the
save path, the rename windows, one run per directory, reuse / overwrite / changed-config resume, SIGTERM and Ctrl-C,
a full disk, a corrupt checkpoint. Real processes and real signals; ``fault_driver.py`` places the faults."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fault_driver import same, sigterm_at, strays, weights
from pipeline_args import TINY, files_of, img, small_heads

from patchplace.data.manifest import sha256_file
from patchplace.pipelines import pretrain
from patchplace.pipelines.engine import protocol

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # end to end: real runs of the pipelines

DRIVER = str(ROOT / "tests" / "fault_driver.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def stop_args(shards: Path, out: Path, steps: int = 6) -> list[str]:
    """StoP (masks, noise, EMA target): the method with the most state to lose."""
    return ["method=stop", *img(shards), *TINY, *small_heads("stop"), f"optim.max_steps={steps}",
            f"run.output={out}"]


def drive(*params: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, DRIVER, *params, "--", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def logged_steps(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def straight(shards, tmp_path_factory):
    """The weights of an uninterrupted StoP run of ``steps`` steps (:func:`stop_args`), run once per module: the
    reference every resumed run of that length must end on."""
    done: dict[int, dict] = {}

    def weights_of(steps: int) -> dict:
        if steps not in done:
            out = tmp_path_factory.mktemp(f"straight-{steps}") / "run"
            assert pretrain.main(stop_args(shards, out, steps)) == 0
            done[steps] = weights(out)
        return done[steps]

    return weights_of


def test_a_kill_at_any_line_of_a_save_loses_nothing(shards, tmp_path):
    """SIGKILL at every distinct line of the checkpoint protocol (engine/protocol.py) in the middle save, and at 6
    random lines of the whole save path (torch / safetensors / Accelerate writes included) of any save: each killed run
    resumes from its newest complete checkpoint (never step 0 once one exists), ends with the uninterrupted run's
    weights, logs every step once, and leaves no partial / trash file after its next save."""
    report = tmp_path / "report.json"
    args = [*stop_args(shards, tmp_path / "unused"), "run.checkpoint_every=2"]
    result = drive("kills", str(report), str(tmp_path), "18", "6", args=args)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    saves, kills = data["saves"], data["kills"]
    assert [s["step"] for s in saves] == [2, 4, 6] and all(s["events"] > 1000 for s in saves)
    assert len(kills) == saves[1]["rundir_lines"] + 6 >= 40, "every protocol line of the middle save + 6 random"
    for kill in kills:
        assert kill["killed"], kill
        complete = [int(n[5:]) for n in kill["left"] if n.startswith("step-")]
        assert kill["resumed_from"] == max(complete, default=0), kill  # the newest complete checkpoint
        assert kill["resume_code"] == 0 and kill["same_weights"] and kill["steps_logged_once"], kill
        assert kill["strays"] == [] and kill["again_code"] in (0, None), kill
    assert sum(k["again_code"] == 0 for k in kills) >= len(kills) // 4, "a finished run resumes as complete"
    windows = {tuple(sorted(n.split("-")[0] for n in k["left"])) for k in kills}
    assert {(".partial", "step"), ("step", "step"), (".trash", "step")} <= windows, windows


def test_the_rename_windows_and_leftovers_resume_from_the_newest_checkpoint(shards, tmp_path, straight):
    """Deterministic versions of the kill windows: a new step committed while the ``checkpoint`` link still points
    at the old one; the old step already renamed to trash; plus a partial step directory a killed save left."""
    for window in ("link_not_swapped", "old_step_trashed"):
        out = tmp_path / window
        with sigterm_at(2):
            assert pretrain.main([*stop_args(shards, out), "run.checkpoint_every=2"]) == 143
        two = out / "checkpoints" / "step-00000002"
        keep = tmp_path / f"{window}-step2"
        shutil.copytree(two, keep)
        with sigterm_at(4):
            assert pretrain.main([*stop_args(shards, out), "run.checkpoint_every=2", "run.resume=true"]) == 143
        if window == "link_not_swapped":
            shutil.copytree(keep, two)
            protocol.point_checkpoint_link(out, two / "checkpoint")
        else:
            shutil.copytree(keep, out / "checkpoints" / ".trash-step-00000002-1")
        (out / "checkpoints" / ".partial-step-00000005").mkdir()
        assert pretrain.main([*stop_args(shards, out), "run.checkpoint_every=2", "run.resume=true"]) == 0
        assert same(weights(out), straight(6)), window
        assert logged_steps(out) == [1, 2, 3, 4, 5, 6] and strays(out) == [], window
        assert os.readlink(out / "checkpoint") == os.path.join("checkpoints", "step-00000006", "checkpoint")


def test_one_run_per_directory(shards, tmp_path, capsys):
    out = tmp_path / "run"
    lock = protocol.RunLock(out).acquire()  # another process would hold this flock while it trains
    try:
        assert pretrain.main(stop_args(shards, out, 2)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"process {os.getpid()}" in err and "is in use by" in err, err
    finally:
        lock.release()
    # a lock file left by a killed run (no process holds the flock) is taken over
    assert (out / ".lock").is_file() and pretrain.main(stop_args(shards, out, 2)) == 0
    capsys.readouterr()
    # reusing the directory: an error unless resumed or overwritten
    assert pretrain.main(stop_args(shards, out, 2)) == 2
    err = capsys.readouterr().err
    assert "already holds a run with a checkpoint at step 2: continue it with run.resume=true, replace it with " \
           "run.overwrite=true" in err, err
    assert pretrain.main([*stop_args(shards, out, 2), "optim.lr=0.1", "run.resume=true"]) == 2
    err = capsys.readouterr().err
    assert "run.resume=true: optim.lr (0.0015 -> 0.1) differ from" in err, err
    assert pretrain.main([*stop_args(shards, out, 3), "run.overwrite=true"]) == 0
    assert logged_steps(out) == [1, 2, 3] and [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_sigterm_and_ctrl_c_save_and_say_how_to_resume(shards, tmp_path, straight, name, code):
    """A real signal to a real process (the exit code is the process's); the resume, a run like any other, in this
    one."""
    out = tmp_path / "run"
    result = drive("signal", name, "3", args=stop_args(shards, out))
    assert result.returncode == code, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"interrupted by {name} at step 3: checkpoint saved in {out}/checkpoints; resume "
                              "with: python pipelines/pretrain.py method=stop "), message
    assert message.endswith("run.resume=true") and f"run.output={out}" in message, message
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    if name == "SIGTERM":  # the resumed run ends where an uninterrupted one does
        assert pretrain.main([*stop_args(shards, out), "run.resume=true"]) == 0
        assert same(weights(out), straight(6)) and logged_steps(out) == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(shards, tmp_path):
    """RLIMIT_FSIZE makes every write past 16 KB fail from the step-4 checkpoint on (like a full disk)."""
    out = tmp_path / "run"
    result = drive("fsize", str(16 * 1024), "4", args=[*stop_args(shards, out), "run.checkpoint_every=2"])
    assert result.returncode == 2, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "could not write the step-4 checkpoint" in error[0], result.stderr[-2000:]
    assert "disk is full or a size limit was hit" in error[0] and "MiB free" in error[0]
    assert "GiB on the filesystem mounted at /" in error[0], "it names the disk to free"
    assert "the last complete checkpoint (step 2) is intact" in error[0] and "run.resume=true" in error[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"], "nothing half-written is left"
    assert pretrain.main([*stop_args(shards, out), "run.checkpoint_every=2", "run.resume=true"]) == 0


def test_a_corrupt_checkpoint_file_stops_the_resume_naming_it(shards, tmp_path, capsys):
    out = tmp_path / "run"
    with sigterm_at(2):
        assert pretrain.main(stop_args(shards, out)) == 143
    rng_state = out / "checkpoints" / "step-00000002" / "state" / "random_states_0.pkl"
    data = bytearray(rng_state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rng_state.write_bytes(bytes(data))
    capsys.readouterr()
    assert pretrain.main([*stop_args(shards, out), "run.resume=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"checkpoint file {rng_state} is corrupt" in err, err


def test_files_follow_the_umask(tmp_path):
    """With umask 022, split directories / checkpoints are 0755 and manifest.json / optimizer.json 0644, readable
    by the rest of a shared cluster (tempfile's own modes, 0700 / 0600, would not be)."""
    import numpy as np

    from patchplace.data import SplitWriter

    previous = os.umask(0o022)
    try:
        with SplitWriter(tmp_path / "shards", "train", dataset="toy", modality="image", classes=["a", "b", "c"],
                         info={"image_size": [28, 28], "channels": 1}, source="test", recipe="test",
                         recipe_version=1, max_count=16) as writer:
            for i in range(48):
                writer.add_image(f"{i:04d}", i % 3, np.full((28, 28), i, dtype=np.uint8))
        shards = tmp_path / "shards"
        out = tmp_path / "run"
        assert pretrain.main(["method=stop", f"data.train={shards / 'train'}", f"data.val={shards / 'train'}", *TINY,
                              *small_heads("stop"), "optim.max_steps=1", f"run.output={out}"]) == 0
    finally:
        os.umask(previous)
    mode = lambda p: oct(p.stat().st_mode & 0o777)  # noqa: E731
    split = shards / "train"
    assert mode(split) == "0o755" and mode(split / "manifest.json") == "0o644"
    assert {mode(p) for p in split.glob("*.tar")} == {"0o644"}
    step = out / "checkpoints" / "step-00000001"
    assert mode(step) == mode(step / "checkpoint") == mode(step / "state") == "0o755"
    assert {mode(p) for p in step.rglob("*") if p.is_file()} == {"0o644"}
    assert mode(out / "optimizer.json") == mode(out / "config.yaml") == mode(out / "log.jsonl") == "0o644"


# ---------------------------------------------------------------------------------------------- errors mid-run
def copy_shards(shards: Path, tmp_path: Path) -> Path:
    root = tmp_path / "shards"
    shutil.copytree(shards / "img", root)
    return root


def rewrite_label(tar_path: Path, key: str, label: bytes) -> None:
    """Replace one sample's .cls member in a shard (what a flipped byte on disk does to it)."""
    import io
    import tarfile

    members = []
    with tarfile.open(tar_path) as tar:
        for info in tar.getmembers():
            members.append((info, label if info.name == f"{key}.cls" else tar.extractfile(info).read()))
    with tarfile.open(tar_path, "w") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_truncated_shard_mid_training_is_one_line_or_skipped_and_counted(shards, tmp_path, capsys, workers):
    root = copy_shards(shards, tmp_path)
    bad = root / "train" / "train-000002.tar"
    bad.write_bytes(bad.read_bytes()[:5000])
    args = ["method=supervised", f"data.train={root / 'train'}", f"data.val={root / 'test'}", *TINY,
            f"data.num_workers={workers}", "optim.max_steps=8"]
    assert pretrain.main([*args, f"run.output={tmp_path / 'fail'}"]) == 2
    line = error_line(capsys)
    assert f"corrupt shard {bad}" in line and "data.skip_corrupt=true" in line, line
    assert not (tmp_path / "fail" / "checkpoints").exists()
    if workers == 0:  # skip and count
        with pytest.warns(UserWarning, match="skipping corrupt shard"):
            assert pretrain.main([*args, "data.skip_corrupt=true", f"run.output={tmp_path / 'skip'}"]) == 0
        log = [json.loads(line) for line in (tmp_path / "skip" / "log.jsonl").read_text().splitlines()]
        assert [r for r in log if "loss" in r][-1]["skipped_shards"] >= 1


def test_a_flipped_label_byte_names_the_shard_and_key(shards, tmp_path, capsys):
    """A shard changed after its split was written (here a label byte) fails its manifest's sha256 before any of
    its samples is used; with the check off (data.verify_shards=false) the bad label itself is still named."""
    from patchplace.data.manifest import sha256_file

    root = copy_shards(shards, tmp_path)
    shard = root / "train" / "train-000000.tar"
    rewrite_label(shard, "0003", b"Z")
    args = ["method=supervised", f"data.train={root / 'train'}", f"data.val={root / 'test'}", *TINY,
            "optim.max_steps=8"]
    assert pretrain.main([*args, f"run.output={tmp_path / 'run'}"]) == 2
    line = error_line(capsys)
    assert f"corrupt shard {shard}: sha256 {sha256_file(shard)} differs from the manifest's " in line, line
    assert f"python -m patchplace.data verify {root / 'train'}" in line, line
    assert pretrain.main([*args, "data.verify_shards=false", f"run.output={tmp_path / 'unverified'}"]) == 2
    line = error_line(capsys)
    assert f"sample 0003 in {shard}: its .cls is not a class index (b'Z')" in line, line


def test_inputs_the_model_cannot_take_are_one_line_before_training(shards, tmp_path, capsys):
    common = [*img(shards), *TINY, "optim.max_steps=1"]
    assert pretrain.main(["method=supervised", *common, "data.img_size=30", f"run.output={tmp_path / 'a'}"]) == 2
    assert "the data give 30 px images (data.img_size / data.pad_to) but model.preset=vit_micro takes 32 px: set " \
           "data.img_size=32" in error_line(capsys)
    # a speech checkpoint fine-tuned on images said "pos_embed 'sincos1d' is not available for image"
    from pipeline_args import audio

    speech = tmp_path / "speech"
    assert pretrain.main(["method=mp3_speech", *audio(shards), *TINY, "model.preset=audio_mp3", "optim.max_steps=1",
                          f"run.output={speech}"]) == 0
    from patchplace.pipelines import finetune

    capsys.readouterr()
    common = [a for a in common if not a.startswith("model.preset=")]  # a checkpoint brings its architecture
    assert finetune.main([*common, f"model.checkpoint={speech / 'checkpoint'}", f"run.output={tmp_path / 'b'}"]) == 2
    assert f"model.checkpoint={speech / 'checkpoint'} is a model for audio but data.train (toy/train) holds " \
           "image" in error_line(capsys)
    # a pickle saved under the safetensors name
    fake = tmp_path / "fake"
    shutil.copytree(speech / "checkpoint", fake)
    import torch

    torch.save({"w": torch.zeros(3)}, fake / "model.safetensors")
    assert finetune.main([*common, f"model.checkpoint={fake}", f"run.output={tmp_path / 'c'}"]) == 2
    assert f"{fake / 'model.safetensors'} is not a readable safetensors file" in error_line(capsys)
    # a run.output that cannot be created
    (tmp_path / "file").write_text("x")
    assert pretrain.main(["method=supervised", *common, f"run.output={tmp_path / 'file' / 'run'}"]) == 2
    assert f"run.output {tmp_path / 'file' / 'run'} cannot be written (Not a directory)" in error_line(capsys)


def test_data_settings_that_cannot_work_name_the_key_and_the_fix(shards, tmp_path, capsys):
    common = [*TINY, "method=supervised", "optim.max_steps=1"]
    root = copy_shards(shards, tmp_path)
    assert pretrain.main([*common, f"data.train={root}", f"data.val={root / 'test'}",
                          f"run.output={tmp_path / 'a'}"]) == 2
    assert f"{root} is a dataset directory, not a split: use one of its splits ({root / 'test'}, " \
           f"{root / 'train'})" in error_line(capsys)
    data = [f"data.train={root / 'train'}", f"data.val={root / 'test'}"]
    assert pretrain.main([*common, *data, "data.train_limit=640", f"run.output={tmp_path / 'b'}"]) == 2
    assert "data.train_limit=640: each process can read at most 64 samples per epoch of toy/train with 1 " \
           "process(es); set it in [1, 64] or null" in error_line(capsys)
    manifest = root / "train" / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["shards"][0]["count"] = "sixteen"
    manifest.write_text(json.dumps(raw))
    assert pretrain.main([*common, *data, f"run.output={tmp_path / 'c'}"]) == 2
    assert f"{manifest}: a field has the wrong type or shape" in error_line(capsys)


# ---------------------------------------------------------------------------------- non-finite values, a full disk
def reseal(step: Path) -> None:
    """Rewrite a checkpoint's COMPLETE record to match its files as they are now: damage the seal cannot see."""
    record = json.loads((step / "COMPLETE").read_text())
    record["files"] = {name: {"bytes": (step / name).stat().st_size, "sha256": sha256_file(step / name)}
                       for name in record["files"]}
    (step / "COMPLETE").write_text(json.dumps(record))


def errors_of(result: subprocess.CompletedProcess) -> list[str]:
    return errors_of_text(result.stderr)


def errors_of_text(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def finetune_args(shards: Path, out: Path, steps: int = 4) -> list[str]:
    return [*img(shards), *TINY, f"optim.max_steps={steps}", "finetune.mixup=0", "finetune.cutmix=0",
            "run.eval_every=2", f"run.output={out}"]


def test_a_nan_loss_stops_the_run_in_one_line_and_keeps_the_last_good_checkpoint(shards, tmp_path, capsys,
                                                                                  straight):
    """A NaN at step 5 (injected into the inputs) stops the run before it reaches the weights: one line naming the step,
    the loss and what to try; the step-4 checkpoint stays and is finite; the run resumes from it (the NaN came from
    outside: the resumed run ends with an uninterrupted run's weights)."""
    out = tmp_path / "run"
    result = drive("nan", "5", args=[*stop_args(shards, out, 8), "run.checkpoint_every=2"])
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = errors_of(result)
    assert line.startswith("error: training diverged at step 5: the loss is nan on rank 0; nothing of it was saved, "
                           f"the last good checkpoint (step 4) is kept in {out / 'checkpoints'}; try a lower "
                           "optim.lr"), line
    assert "Traceback" not in result.stderr and logged_steps(out) == [1, 2, 3, 4]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000004"]
    assert pretrain.main([*stop_args(shards, out, 8), "run.checkpoint_every=2", "run.resume=true"]) == 0
    assert same(weights(out), straight(8))
    # a real divergence: lr 1e9 never writes a checkpoint of non-finite weights
    huge = tmp_path / "huge"
    capsys.readouterr()
    assert pretrain.main(["method=supervised", *img(shards), *TINY, "optim.max_steps=6", "optim.lr=1e9",
                          "run.checkpoint_every=1", f"run.output={huge}"]) == 2
    assert error_line(capsys).startswith("error: training diverged at step")
    from patchplace.models import load_pretrained

    if (huge / "checkpoint").exists():  # whatever was kept loads: finite weights
        load_pretrained(huge / "checkpoint")


def test_a_nan_loss_under_the_lazy_check_skips_its_update_and_stops_at_the_next_checkpoint_in_one_line(shards,
                                                                                                       tmp_path):
    """run.finite_check=lazy (no host sync per step, a GPU knob): the NaN of step 5 is flagged on the device, AdamW's
    fused kernel skips its update, and the run stops at step 6 (a checkpoint step) before saving anything, with the
    per-step check's line naming step 5; the step-4 checkpoint resumes to an uninterrupted lazy run's weights."""
    lazy = ["run.finite_check=lazy", "optim.fused=true", "run.log_every=4", "run.checkpoint_every=2"]
    out = tmp_path / "run"
    result = drive("nan", "5", args=[*stop_args(shards, out, 8), *lazy])
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = errors_of(result)
    assert line.startswith("error: training diverged at step 5: the loss is nan on rank 0 (seen at step 6: "
                           "run.finite_check=lazy; the step's update was skipped); nothing of it was saved, the last "
                           f"good checkpoint (step 4) is kept in {out / 'checkpoints'}"), line
    assert "Traceback" not in result.stderr and logged_steps(out) == [4]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000004"]
    assert pretrain.main([*stop_args(shards, out, 8), *lazy, "run.resume=true"]) == 0
    straight = tmp_path / "straight"
    assert pretrain.main([*stop_args(shards, straight, 8), *lazy]) == 0
    assert same(weights(out), weights(straight))
    assert pretrain.main([*stop_args(shards, tmp_path / "foreach", 2), "run.finite_check=lazy",
                          "optim.fused=false"]) == 2  # the skip needs the fused kernel: refused up front


def test_the_lazy_check_skips_exactly_the_non_finite_steps_update_inside_the_fused_kernel():
    """The lazy check's pieces on one parameter: a NaN loss (and its NaN gradient) leaves the weight, AdamW's moments
    and step count as they were, a finite step after it updates as usual, and the check names the first bad step
    with its loss."""
    import types

    import torch

    from patchplace.pipelines import engine

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    check = engine.FiniteCheck(types.SimpleNamespace(num_processes=1, device=torch.device("cpu")), "lazy",
                               lambda step, what: f"step {step}: {what}")
    for step, value in ((1, 1.0), (2, float("nan")), (3, 1.0)):
        loss = (weight * value).sum()
        check.loss(loss, step)
        optimizer.zero_grad()
        loss.backward()
        before = (weight.detach().clone(), optimizer.state[weight].get("exp_avg", torch.zeros(3)).clone())
        check.before_update(optimizer, None, step)
        optimizer.step()
        moved = not torch.equal(weight.detach(), before[0])
        assert moved == (step != 2) and torch.isfinite(weight).all(), step
        if step == 2:
            assert torch.equal(optimizer.state[weight]["exp_avg"], before[1]) and optimizer.state[weight]["step"] == 1
    assert optimizer.state[weight]["step"] == 2
    with pytest.raises(engine.Diverged, match=r"step 2: the loss is nan on rank 0 \(seen at step 3"):
        check.settle(3)


def test_a_nan_checkpoint_is_refused_by_finetune_evaluate_export_and_onnx_runtime(shards, tmp_path, capsys):
    """A checkpoint of NaN weights (planted: training never writes one): fine-tuning, evaluation, the ONNX export
    and ONNX Runtime's evaluation each stop with one line; no accuracy is reported (an argmax of NaN would still
    "score" a class), no file exported (a parity gate comparing NaN with NaN must not pass)."""
    import torch

    from patchplace.models import load_pretrained, save_pretrained
    from patchplace.pipelines import evaluate, finetune

    good = tmp_path / "good"
    assert finetune.main(finetune_args(shards, good, 2)) == 0
    backbone, metadata = load_pretrained(good / "checkpoint")
    with torch.no_grad():
        backbone.head.weight.fill_(float("nan"))
    nan = save_pretrained(backbone, tmp_path / "nan", metadata=metadata)
    capsys.readouterr()
    assert finetune.main([*finetune_args(shards, tmp_path / "ft", 2), f"model.checkpoint={nan}"]) == 2
    assert "holds non-finite weights (NaN / inf in 1 tensor(s), e.g. head.weight)" in error_line(capsys)
    assert evaluate.main([*img(shards), "data.num_workers=0", f"model.checkpoint={nan}",
                          f"run.output={tmp_path / 'ev'}"]) == 2
    assert "holds non-finite weights" in error_line(capsys)
    # the export and ONNX Runtime's evaluation as their command lines run them (``python -m``: their main()),
    # here in this process: an exception escaping main() is the traceback the user would see
    from patchplace.export.__main__ import main as export_main
    from patchplace.export.evaluate import main as ort_evaluate_main

    assert export_main([str(nan), "--out", str(tmp_path / "nan.onnx")]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and errors_of_text(err), err[-2000:]
    assert not (tmp_path / "nan.onnx").exists()
    # an ONNX file whose weights turned NaN after export: ONNX Runtime's evaluation reports no top-1
    import onnx
    from onnx import numpy_helper

    onnx_path = tmp_path / "good.onnx"
    assert export_main([str(good / "checkpoint"), "--out", str(onnx_path)]) == 0, capsys.readouterr().err[-2000:]
    graph = onnx.load(str(onnx_path))
    for init in graph.graph.initializer:
        values = numpy_helper.to_array(init)
        if values.dtype.kind == "f" and values.size > 8:
            init.CopyFrom(numpy_helper.from_array(values * float("nan"), init.name))
            break
    onnx.save(graph, str(onnx_path))
    sidecar = onnx_path.with_suffix(".json")
    rate = [str(onnx_path), "--data", str(shards / "img" / "test"), "--out", str(tmp_path / "ort"),
            "--latency-repeats", "0"]
    capsys.readouterr()
    assert ort_evaluate_main(rate) == 2
    err = capsys.readouterr().err
    assert "changed after its export" in err, err[-2000:]
    from patchplace.data.manifest import sha256_file

    record = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**record, "onnx_sha256": sha256_file(onnx_path)}))  # damage the seal cannot see
    assert ort_evaluate_main(rate) == 2
    rated = capsys.readouterr()
    assert "Traceback" not in rated.err, rated.err[-2000:]
    (line,) = errors_of_text(rated.err)
    assert "the model's logits hold NaN on" in line and "no top-1 is reported" in line, line
    assert "top-1" not in rated.out and not (tmp_path / "ort" / "results.json").exists()


def test_a_finished_run_resumes_as_complete_without_touching_its_files(shards, tmp_path, capsys):
    """The end-of-run metrics are sealed with the final checkpoint (written into config.json and the model card
    before COMPLETE), so ``run.resume=true`` (as the demo and study stages pass) finds the finished run intact and
    complete, never corrupt (whose remedy, run.overwrite=true, would delete it)."""
    from patchplace.pipelines import finetune

    out = tmp_path / "ft"
    assert finetune.main(finetune_args(shards, out)) == 0
    step = (out / "checkpoint").resolve().parent
    record = protocol.verify(step)
    metrics = json.loads((out / "checkpoint" / "config.json").read_text())["metadata"]["metrics"]
    assert metrics["count"] == 32 and 0 <= metrics["top1"] <= 1
    assert "config.json" in " ".join(record["files"]) and "top1" in (out / "checkpoint" / "README.md").read_text()
    before = {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    log = (out / "log.jsonl").read_text()
    capsys.readouterr()
    assert finetune.main([*finetune_args(shards, out), "run.resume=true"]) == 0
    assert f"{out} is complete (step 4 of 4); nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == before
    assert (out / "log.jsonl").read_text() == log and protocol.verify(step) == record


def test_a_kill_in_the_last_save_of_a_finetune_keeps_its_metrics_sealed(shards, tmp_path):
    """The kill sweep over the save that seals the end-of-run metrics: every line of the checkpoint protocol and 4
    random lines of that save; each killed run resumes (again: a finished run accepts its own files) and ends with
    the uninterrupted run's weights and its metrics inside the sealed checkpoint."""
    report = tmp_path / "report.json"
    args = ["finetune", *finetune_args(shards, tmp_path / "unused"), "run.checkpoint_every=2"]
    result = subprocess.run([sys.executable, DRIVER, "kills", str(report), str(tmp_path), "29", "4", "--", *args],
                            capture_output=True, text=True, timeout=900, env={**ENV, "KILL_SAVE": "last"})
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert [s["step"] for s in data["saves"]] == [2, 4] and len(data["kills"]) >= 20
    for kill in data["kills"]:
        assert kill["killed"] and kill["resume_code"] == 0 and kill["again_code"] == 0, kill
        assert kill["same_weights"] and kill["steps_logged_once"] and kill["strays"] == [], kill
        assert kill["metrics"] and kill["metrics"]["count"] == 32, kill


def test_a_full_disk_while_logging_is_one_line_and_the_torn_line_does_not_stop_the_resume(shards, tmp_path,
                                                                                          capsys, straight):
    """RLIMIT_FSIZE lets the step-5 log record be written only in part (a full disk): one line, not a traceback,
    and a later resume drops the torn line instead of failing to read the log beside a valid checkpoint."""
    out = tmp_path / "run"
    args = [*stop_args(shards, out, 8), "run.checkpoint_every=2"]
    result = drive("logfull", "5", args=args)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = errors_of(result)
    assert f"could not write {out / 'log.jsonl'}: the disk is full or a size limit was hit" in line, line
    assert "the last complete checkpoint (step 4) is intact" in line and "Traceback" not in result.stderr
    assert not (out / "log.jsonl").read_text().endswith("\n"), "the record was torn"
    assert pretrain.main([*args, "run.resume=true"]) == 0
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().err
    assert same(weights(out), straight(8)) and logged_steps(out) == list(range(1, 9))


def test_damaged_checkpoints_are_refused_in_one_line_and_left_alone(shards, tmp_path, capsys):
    """A step directory without COMPLETE (before: resume restarted at step 0 and deleted it at the next save); a
    random state that cannot be read but matches its seal (before: Accelerate skipped it and the run drew other
    masks); a planted pickle that matches its seal (before: 36 lines quoting torch's advice to set
    weights_only=False). Each: exit 2, one line naming the file, no traceback, the directory untouched, the pickle
    never run."""
    import pickle

    base = tmp_path / "base"
    with sigterm_at(4):
        assert pretrain.main([*stop_args(shards, base), "run.checkpoint_every=2"]) == 143

    def refused(out: Path) -> tuple[str, str]:
        """(the error line, all of stderr) of a resume that must stop with exit 2."""
        capsys.readouterr()
        assert pretrain.main([*stop_args(shards, out), "run.resume=true"]) == 2
        err = capsys.readouterr().err
        (line,) = [line for line in err.splitlines() if line.startswith("error:")]
        return line, err

    def damaged(name: str) -> tuple[Path, Path]:
        out = tmp_path / name
        shutil.copytree(base, out, symlinks=True)
        return out, out / "checkpoints" / "step-00000004"

    out, step = damaged("unsealed")
    (step / "COMPLETE").unlink()
    capsys.readouterr()
    assert pretrain.main([*stop_args(shards, out), "run.resume=true"]) == 2
    assert error_line(capsys) == (
        f"error: {step} has no {step / 'COMPLETE'} record, so it cannot be verified (it was removed or the directory "
        "was copied in part): restore the record, or delete that directory to resume from scratch, or start over "
        "with run.overwrite=true")
    assert step.is_dir() and sorted(p.name for p in step.iterdir()) == ["checkpoint", "state"]

    out, step = damaged("rng")
    (step / "state" / "random_states_0.pkl").write_bytes(b"not a pickle at all")
    reseal(step)
    line, _ = refused(out)
    assert line.startswith(f"error: checkpoint file {step / 'state' / 'random_states_0.pkl'} cannot be loaded: the "
                           "safe (weights-only) loader refuses it (Unsupported operand"), line

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    out, step = damaged("pickle")
    (step / "state" / "optimizer.bin").write_bytes(pickle.dumps({"state": Planted()}))
    reseal(step)
    line, err = refused(out)
    assert line.startswith(f"error: checkpoint file {step / 'state' / 'optimizer.bin'} cannot be loaded: the safe "
                           "(weights-only) loader refuses it"), line
    assert "weights_only" not in err and not (tmp_path / "pwned").exists()
    assert len(err.strip().splitlines()) == 1, err


def test_resume_names_an_empty_directory_and_follows_a_moved_or_respelled_one(shards, tmp_path, monkeypatch, capsys,
                                                                             straight):
    """run.resume=true with nothing to resume says so; the same directory spelled relative / absolute / with a
    trailing slash, or moved elsewhere, resumes (before: refused as 'run.output differs' or restarted)."""
    monkeypatch.chdir(tmp_path)
    with sigterm_at(2):
        assert pretrain.main([*stop_args(shards, Path("rel")), "run.checkpoint_every=2", "run.resume=true"]) == 143
    assert "run.resume=true: rel holds no checkpoint yet; starting at step 0" in capsys.readouterr().out
    with sigterm_at(4):
        assert pretrain.main([*stop_args(shards, Path("rel")), "run.checkpoint_every=2",
                              f"run.output={tmp_path / 'rel'}/", "run.resume=true"]) == 143
    (tmp_path / "rel").rename(tmp_path / "moved")
    assert pretrain.main([*stop_args(shards, tmp_path / "moved"), "run.checkpoint_every=2", "run.resume=true"]) == 0
    assert same(weights(tmp_path / "moved"), straight(6)) and logged_steps(tmp_path / "moved") == [1, 2, 3, 4, 5, 6]


def test_mae_with_a_mask_ratio_that_masks_nothing_is_refused(shards, tmp_path, capsys):
    assert pretrain.main(["method=mae", *img(shards), *TINY, *small_heads("mae"), "objective.mask_ratio=0",
                          "optim.max_steps=1", f"run.output={tmp_path / 'mae'}"]) == 2
    assert "mask_ratio=0 masks none of the 64 patches, so MAE's loss (over the masked patches) is 0" in \
        error_line(capsys)


def test_a_refused_resume_changes_no_file_of_the_run(shards, tmp_path, capsys):
    """A resume refused for a changed recipe, or for a checkpoint of another process count, leaves every file of
    the run as it found it, the lock file included (the refused launch's pid and start time are taken back); the
    process-count refusal names the launch that continues the run, on CPU and on GPUs."""
    import time

    out = tmp_path / "run"
    with sigterm_at(2):
        assert pretrain.main([*stop_args(shards, out), "run.checkpoint_every=2"]) == 143
    before = files_of(out)
    time.sleep(1.1)  # (a lock taken now would record another start time)
    capsys.readouterr()
    assert pretrain.main([*stop_args(shards, out), "optim.lr=0.1", "run.resume=true"]) == 2
    assert "run.resume=true: optim.lr (0.0015 -> 0.1) differ from" in error_line(capsys)
    assert files_of(out) == before
    step = out / "checkpoints" / "step-00000002"  # its record says 2 processes wrote it (resealed to match)
    trainer = json.loads((step / "state" / "trainer.json").read_text())
    (step / "state" / "trainer.json").write_text(json.dumps({**trainer, "world_size": 2}))
    reseal(step)
    before = files_of(out)
    assert pretrain.main([*stop_args(shards, out), "run.resume=true"]) == 2
    line = error_line(capsys)
    assert "written by 2 process(es) x data.batch_size=" in line and "this launch has 1 process(es) x " in line and (
        "(e.g. resume with ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 "
        "pipelines/pretrain.py method=stop ") in line and line.endswith(
        " run.resume=true (on CPU; on 2 GPUs the same without ACCELERATE_USE_CPU=true)), or start a new run (another "
        "run.output, or run.overwrite=true)"), line
    assert files_of(out) == before


def test_a_resume_compares_the_data_by_fingerprint_not_by_path(shards, tmp_path, capsys, straight):
    """The checkpoint records its data's fingerprints (data.train, data.val) and a resume compares them, not the
    paths: the same shards copied elsewhere resume exactly (before: refused as a changed data.train), a split
    rebuilt in place with other images and labels is refused in one line naming both fingerprints, every file of
    the run left as it was (before: it resumed silently)."""
    from patchplace.data import Manifest, SplitWriter

    original = tmp_path / "data"
    shutil.copytree(shards / "img", original / "img")
    run, other = tmp_path / "run", tmp_path / "other"
    for out in (run, other):
        with sigterm_at(2):
            assert pretrain.main([*stop_args(original, out), "run.checkpoint_every=2"]) == 143
    recorded = json.loads((run / "checkpoints" / "step-00000002" / "state" / "trainer.json").read_text())["data"]
    train = original / "img" / "train"
    old = Manifest.load(train).fingerprint()
    assert recorded == {"data.train": old, "data.val": Manifest.load(original / "img" / "test").fingerprint()}
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert pretrain.main([*stop_args(copy, run), "run.checkpoint_every=2", "run.resume=true"]) == 0
    assert same(weights(run), straight(6)) and logged_steps(run) == [1, 2, 3, 4, 5, 6]

    shutil.rmtree(train)  # the same split rebuilt with other images and labels
    rng = __import__("numpy").random.default_rng(1)
    with SplitWriter(original / "img", "train", dataset="toy", modality="image", classes=["a", "b", "c"],
                     info={"image_size": [28, 28], "channels": 1}, source="test", recipe="test", recipe_version=1,
                     max_count=16) as w:
        for i in range(64):
            w.add_image(f"{i:04d}", (i + 1) % 3, rng.integers(0, 256, (28, 28), dtype="uint8"))
    new = Manifest.load(train).fingerprint()
    before = files_of(other)
    capsys.readouterr()
    assert pretrain.main([*stop_args(original, other), "run.checkpoint_every=2", "run.resume=true"]) == 2
    assert error_line(capsys) == (
        f"error: run.resume=true: data.train={train} holds other data (fingerprint {new[:16]}) than the step-2 "
        f"checkpoint in {other} was trained on (fingerprint {old[:16]}): point data.train at that data (its path "
        "may change: the fingerprint is compared, not the path), or train on this data in a new run (another "
        "run.output, or run.overwrite=true)")
    assert files_of(other) == before
