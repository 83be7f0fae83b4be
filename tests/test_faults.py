"""Runs that survive faults (issue 18): kills at every line of the checkpoint protocol and at random points of the
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pipelines"))

import pretrain  # noqa: E402
import rundir  # noqa: E402

from tests.fault_driver import same, strays, weights  # noqa: E402
from tests.pipeline_args import SMALL_HEADS, TINY, img  # noqa: E402

DRIVER = str(ROOT / "tests" / "fault_driver.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def stop_args(shards: Path, out: Path, steps: int = 6) -> list[str]:
    """StoP (masks, noise, EMA target): the method with the most state to lose."""
    return ["method=stop", *img(shards), *TINY, *SMALL_HEADS["stop"], f"optim.max_steps={steps}",
            f"run.output={out}"]


def drive(*params: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, DRIVER, *params, "--", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def python(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pipelines" / "pretrain.py"), *args], capture_output=True,
                          text=True, timeout=300, env=ENV)


def logged_steps(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def test_a_kill_at_any_line_of_a_save_loses_nothing(shards, tmp_path):
    """SIGKILL at every distinct line of the checkpoint protocol (rundir.py) in the middle save, and at 6 random
    lines of the whole save path (torch / safetensors / Accelerate writes included) of any save: each killed run
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
        assert kill["strays"] == [], kill
    windows = {tuple(sorted(n.split("-")[0] for n in k["left"])) for k in kills}
    assert {(".partial", "step"), ("step", "step"), (".trash", "step")} <= windows, windows


def test_the_rename_windows_and_leftovers_resume_from_the_newest_checkpoint(shards, tmp_path):
    """Deterministic versions of the kill windows: a new step committed while the ``checkpoint`` link still points
    at the old one; the old step already renamed to trash; plus leftovers of the previous layout (issue 18 case 1:
    a half-deleted ``.state.old`` made every later save fail)."""
    straight = tmp_path / "straight"
    assert pretrain.main(stop_args(shards, straight)) == 0
    for window in ("link_not_swapped", "old_step_trashed"):
        out = tmp_path / window
        assert pretrain.main([*stop_args(shards, out), "run.checkpoint_every=2", "run.stop_after=2"]) == 0
        two = out / "checkpoints" / "step-00000002"
        keep = tmp_path / f"{window}-step2"
        shutil.copytree(two, keep)
        assert pretrain.main([*stop_args(shards, out), "run.checkpoint_every=2", "run.stop_after=4",
                              "run.resume=true"]) == 0
        if window == "link_not_swapped":
            shutil.copytree(keep, two)
            rundir.point_checkpoint_link(out, two / "checkpoint")
        else:
            shutil.copytree(keep, out / "checkpoints" / ".trash-step-00000002-1")
        (out / ".state.old").mkdir()
        (out / ".state.old" / "x").touch()
        (out / "checkpoints" / ".partial-step-00000005").mkdir()
        assert pretrain.main([*stop_args(shards, out), "run.checkpoint_every=2", "run.resume=true"]) == 0
        assert same(weights(out), weights(straight)), window
        assert logged_steps(out) == [1, 2, 3, 4, 5, 6] and strays(out) == [], window
        assert os.readlink(out / "checkpoint") == os.path.join("checkpoints", "step-00000006", "checkpoint")


def test_one_run_per_directory(shards, tmp_path, capsys):
    out = tmp_path / "run"
    lock = rundir.RunLock(out).acquire()  # another process would hold this flock while it trains
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
def test_sigterm_and_ctrl_c_save_and_say_how_to_resume(shards, tmp_path, name, code):
    out = tmp_path / "run"
    result = drive("signal", name, "3", args=stop_args(shards, out))
    assert result.returncode == code, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"interrupted by {name} at step 3: checkpoint saved in {out}/checkpoints; resume "
                              "with: python pipelines/pretrain.py method=stop "), message
    assert message.endswith("run.resume=true") and f"run.output={out}" in message, message
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    if name == "SIGTERM":  # the resumed run ends where an uninterrupted one does
        straight = tmp_path / "straight"
        assert python(stop_args(shards, straight)).returncode == 0
        resumed = python([*stop_args(shards, out), "run.resume=true"])
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert same(weights(out), weights(straight)) and logged_steps(out) == [1, 2, 3, 4, 5, 6]


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
    assert python([*stop_args(shards, out), "run.checkpoint_every=2", "run.resume=true"]).returncode == 0


def test_a_corrupt_checkpoint_file_stops_the_resume_naming_it(shards, tmp_path, capsys):
    out = tmp_path / "run"
    assert pretrain.main([*stop_args(shards, out), "run.stop_after=2"]) == 0
    rng_state = out / "checkpoints" / "step-00000002" / "state" / "random_states_0.pkl"
    data = bytearray(rng_state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rng_state.write_bytes(bytes(data))
    capsys.readouterr()
    assert pretrain.main([*stop_args(shards, out), "run.resume=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"checkpoint file {rng_state} is corrupt" in err, err


def test_files_follow_the_umask(tmp_path):
    """Issue 18 case 9: with umask 022, split directories / checkpoints were created 0700 and manifest.json /
    optimizer.json 0600 (tempfile's modes), unreadable by the rest of a shared cluster."""
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
                              *SMALL_HEADS["stop"], "optim.max_steps=1", f"run.output={out}"]) == 0
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
        assert log[-1]["skipped_shards"] >= 1


def test_a_flipped_label_byte_names_the_shard_and_key(shards, tmp_path, capsys):
    root = copy_shards(shards, tmp_path)
    rewrite_label(root / "train" / "train-000000.tar", "0003", b"Z")
    assert pretrain.main(["method=supervised", f"data.train={root / 'train'}", f"data.val={root / 'test'}", *TINY,
                          "optim.max_steps=8", f"run.output={tmp_path / 'run'}"]) == 2
    line = error_line(capsys)
    assert f"sample 0003 in {root / 'train' / 'train-000000.tar'}: its .cls is not a class index (b'Z')" in line


def test_inputs_the_model_cannot_take_are_one_line_before_training(shards, tmp_path, capsys):
    common = [*img(shards), *TINY, "optim.max_steps=1"]
    assert pretrain.main(["method=supervised", *common, "data.img_size=30", f"run.output={tmp_path / 'a'}"]) == 2
    assert "the data give 30 px images (data.img_size / data.pad_to) but model.preset=vit_micro takes 32 px: set " \
           "data.img_size=32" in error_line(capsys)
    # a speech checkpoint fine-tuned on images said "pos_embed 'sincos1d' is not available for image"
    from tests.pipeline_args import audio

    speech = tmp_path / "speech"
    assert pretrain.main(["method=mp3_speech", *audio(shards), *TINY, "model.preset=audio_mp3", "optim.max_steps=1",
                          f"run.output={speech}"]) == 0
    import finetune

    capsys.readouterr()
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
