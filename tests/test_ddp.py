"""Real multi-process runs on CPU (gloo), launched the way the README says: ``ACCELERATE_USE_CPU=true accelerate
launch --multi_gpu --num_processes 2 ...`` (``--cpu --num_processes 2`` would start one process), and two
"machines" of one process each on loopback. ``ddp_trace.py`` records, inside each rank, what these tests check:
the world size, the samples each rank read, the masks each rank drew, the DDP all-reduces and the weights."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fault_driver import sigterm_at
from pipeline_args import TINY, files_of, img, run_log, small_heads, state_dir
from safetensors.torch import load_file

from patchplace.pipelines import pretrain

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # end to end: real runs of the pipelines

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
TRACE = str(ROOT / "tests" / "ddp_trace.py")
PRETRAIN = str(ROOT / "pipelines" / "pretrain.py")
ENV = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
COMMON = ["--mixed_precision", "no", "--dynamo_backend", "no"]


def launch_command(processes: int = 2) -> list[str]:
    """The README's one-machine command (port 0: a free one)."""
    return [ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            *COMMON, "--main_process_port", "0"]


def run(args: list[str], processes: int = 2, env: dict | None = None, check: bool = True, timeout: int = 300
        ) -> subprocess.CompletedProcess:
    command = launch_command(processes) if processes > 1 else [sys.executable]  # 1: plain python
    result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout,
                            env={**ENV, **(env or {})})
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def traces(out: Path) -> list[dict]:
    found = sorted((out / "trace").glob("rank*.pt"))
    return [torch.load(p, weights_only=False) for p in found]


log = run_log  # a run's training-step records (everything=True: all of them)


def mp3_run(shards: Path, steps: int = 3) -> list[str]:
    """A traced tiny MP3 pretraining of ``steps`` steps, its run.output left to add."""
    return [TRACE, "pretrain", "method=mp3", *img(shards), *TINY, f"optim.max_steps={steps}"]


def mp3_args(shards: Path, out: Path, steps: int = 3) -> list[str]:
    return [*mp3_run(shards, steps), f"run.output={out}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flat(steps: list[list[str]]) -> list[str]:
    return [key for keys in steps for key in keys]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs that several tests read (none writes into one): ``reference(args, processes)`` launches
    ``args`` with a run.output of its own once in this module and returns that folder."""
    runs: dict[tuple, Path] = {}

    def launched(args: list[str], processes: int = 2) -> Path:
        key = (processes, *args)
        if key not in runs:
            out = tmp_path_factory.mktemp("reference") / "run"
            run([*args, f"run.output={out}"], processes=processes)
            runs[key] = out
        return runs[key]

    return launched


@pytest.fixture(scope="module")
def mp3_two_process(shards, reference) -> Path:
    return reference(mp3_run(shards))


# The README's command on pipelines/pretrain.py itself, for every method (world size, one log line per step,
# the checkpoint and each rank's random state; RandSAC's and MJP's parameters without gradient on some steps
# under DDP) is checked by the scale rehearsal's pretraining runs (test_scale_rehearsal.check_two_processes).


def test_ranks_share_weights_read_disjoint_samples_and_draw_their_own_masks(shards, tmp_path, mp3_two_process):
    first = traces(mp3_two_process)
    assert [(t["rank"], t["world_size"]) for t in first] == [(0, 2), (1, 2)], "two ranks ran, in one world of 2"
    rank0, rank1 = first
    assert not same_weights(rank0["initial"], rank0["final"]), "training changed the weights"
    assert same_weights(rank0["final"], rank1["final"]), "DDP keeps the ranks' weights identical"
    keys0, keys1 = (flat(t["keys"]) for t in first)
    assert len(keys0) == len(keys1) == 3 * 8 and not set(keys0) & set(keys1), "each rank reads its own samples"
    assert log(mp3_two_process)[-1]["data"]["train"] == "memory", "(the in-memory path: auto, the split is small)"
    assert len(rank0["masks"]) == len(rank1["masks"]) == 3
    assert all(not torch.equal(a, b) for a, b in zip(rank0["masks"], rank1["masks"], strict=True)), \
        "each rank draws its own masks (seed + rank)"
    # The whole run is reproducible from its seed: same samples, masks and weights on a second launch.
    again = tmp_path / "again"
    run(mp3_args(shards, again))
    for a, b in zip(first, traces(again), strict=True):
        assert a["keys"] == b["keys"] and all(torch.equal(x, y) for x, y in zip(a["masks"], b["masks"], strict=True))
        assert same_weights(a["final"], b["final"])
    assert log(again) == log(mp3_two_process) or all(  # equal up to the measured rates
        {k: v for k, v in x.items() if k not in ("samples_per_s", "data_share", "startup_s")}
        == {k: v for k, v in y.items() if k not in ("samples_per_s", "data_share", "startup_s")}
        for x, y in zip(log(again), log(mp3_two_process), strict=True))


def test_two_machines_on_loopback_split_the_shards_by_node(shards, tmp_path):
    """``--num_machines 2 --machine_rank {0,1}``, one process each, rendezvous on 127.0.0.1: the same run as two
    processes on one machine (same weights). Streaming (``data.in_memory=false``): each node reads its own shards."""
    streaming = ["data.in_memory=false"]
    one_machine = tmp_path / "one_machine"
    run([*mp3_args(shards, one_machine), *streaming])
    out, port = tmp_path / "nodes", free_port()
    nodes = [subprocess.Popen([ACCELERATE, "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "2",
                               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port",
                               str(port), *COMMON, *mp3_args(shards, out), *streaming], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in results]
    node0, node1 = traces(out)
    assert (node0["rank"], node1["rank"], node0["world_size"]) == (0, 1, 2)
    shards0, shards1 = ({int(k) // 16 for k in flat(t["keys"])} for t in (node0, node1))  # 16 samples a shard
    assert shards0 and shards1 and not shards0 & shards1, f"nodes read disjoint shards: {shards0} vs {shards1}"
    assert same_weights(node0["final"], traces(one_machine)[0]["final"])
    assert [r["step"] for r in log(out)] == [1, 2, 3] and log(out)[0]["world_size"] == 2
    assert log(out)[-1]["data"] == {"train": "streaming", "val": "streaming"}


def test_mjp_gives_every_rank_the_same_unknown_pe_gradient_zero_where_no_rank_shuffled(shards, tmp_path):
    """MJP's step is one static graph (the jigsaw selected on the device by each rank's own coin), so E_unk takes
    part in every step: DDP needs no ``find_unused_parameters``; where no rank shuffled (the warm-up) its
    averaged gradient is zero on every rank, where any rank shuffled every rank gets the same non-zero one."""
    out = tmp_path / "mjp"
    run([TRACE, "pretrain", "method=mjp", *img(shards), *TINY, "objective.ratio=0.15",
         "objective.warmup_fraction=0.25", "optim.max_steps=8", f"run.output={out}"])
    rank0, rank1 = traces(out)
    shuffled = [a or b for a, b in zip(rank0["jigsaw"], rank1["jigsaw"], strict=True)]
    assert len(shuffled) == 8 and not any(shuffled[:2]) and any(shuffled[2:]), shuffled
    for any_rank, g0, g1 in zip(shuffled, rank0["unknown_grad"], rank1["unknown_grad"], strict=True):
        assert g0 is not None and torch.equal(g0, g1)
        assert (g0.abs().sum() > 0) == any_rank
    assert same_weights(rank0["final"], rank1["final"])


def test_a_killed_two_process_bf16_run_resumes_where_an_uninterrupted_run_ends(shards, tmp_path):
    """StoP (masks, noise, EMA target) in bf16: rank 0 is SIGKILLed right after its step-4 checkpoint; the launcher
    ends the job (rank 1 does not wait forever); ``run.resume=true`` then ends with the uninterrupted run's weights."""
    args = [TRACE, "pretrain", "method=stop", *img(shards), *TINY, *small_heads("stop"), "optim.max_steps=6",
            "run.mixed_precision=bf16"]
    run([*args, f"run.output={tmp_path / 'straight'}"])
    killed = run([*args, f"run.output={tmp_path / 'cut'}", "run.checkpoint_every=2"], env={"TRACE_KILL": "0:4"},
                 check=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-2000:]
    trainer = json.loads((state_dir(tmp_path / "cut") / "trainer.json").read_text())
    assert {k: trainer[k] for k in ("step", "world_size", "global_batch")} == {"step": 4, "world_size": 2,
                                                                                "global_batch": 16}
    run([*args, f"run.output={tmp_path / 'cut'}", "run.resume=true"])
    for name in ("model.safetensors", "objective.safetensors"):
        a, b = (load_file(str(tmp_path / r / "checkpoint" / name)) for r in ("straight", "cut"))
        assert same_weights(a, b), name
    straight, cut = traces(tmp_path / "straight"), traces(tmp_path / "cut")
    for a, b in zip(straight, cut, strict=True):  # the resumed ranks read exactly steps 5 and 6 of each stream
        assert a["keys"][4:] == b["keys"]


def test_a_failure_on_one_rank_ends_the_job_with_that_ranks_error(shards, tmp_path):
    result = run(mp3_args(shards, tmp_path / "fail", steps=6), env={"TRACE_RAISE": "1:2"}, check=False,
                 timeout=120)
    assert result.returncode != 0
    assert "RuntimeError: injected failure on rank 1 at step 2" in result.stderr
    assert not (tmp_path / "fail" / "checkpoint").exists()


def test_gradient_accumulation_all_reduces_once_per_optimizer_step(shards, tmp_path, mp3_two_process):
    """``run.grad_accum=2``: two micro-batches per optimizer step under ``no_sync`` for the first, so the DDP
    all-reduces (counted by a comm hook) are those of a run without accumulation, with twice the samples read."""
    run([*mp3_args(shards, tmp_path / "two"), "run.grad_accum=2"])
    (one, _), (two, _) = traces(mp3_two_process), traces(tmp_path / "two")
    assert one["allreduce_calls"] >= 3 and two["allreduce_calls"] == one["allreduce_calls"]
    assert len(two["keys"]) == 2 * len(one["keys"]) == 6
    assert [r["step"] for r in log(tmp_path / "two")] == [1, 2, 3]


def test_finetune_and_evaluate_under_two_processes(shards, tmp_path):
    """Fine-tuning an MJP checkpoint (its E_unk frozen: plain supervised steps never use it) on two ranks, with
    evaluation on the main process; ``evaluate.py`` on two processes = on one (the main process evaluates the
    whole splits; the other rank exits)."""
    assert pretrain.main(["method=mjp", *img(shards), *TINY, "objective.ratio=0.15", "optim.max_steps=2",
                          f"run.output={tmp_path / 'mjp'}"]) == 0
    checkpoint = f"model.checkpoint={tmp_path / 'mjp' / 'checkpoint'}"
    run([TRACE, "finetune", *img(shards), *TINY, checkpoint, "optim.max_steps=3", "run.eval_every=2",
         f"run.output={tmp_path / 'ft'}"])
    rank0, rank1 = traces(tmp_path / "ft")
    assert (rank0["world_size"], rank1["rank"]) == (2, 1) and same_weights(rank0["final"], rank1["final"])
    assert torch.equal(rank0["final"]["backbone.unknown_pos_embed"], rank0["initial"]["backbone.unknown_pos_embed"])
    assert rank0["group_destroyed"] and rank1["group_destroyed"], "every rank leaves its process group at its end"
    records = log(tmp_path / "ft", everything=True)
    assert [r["step"] for r in records if "eval" in r] == [2, 3], "one evaluation per cadence, main process only"
    assert all(r["eval"]["count"] == 32 for r in records if "eval" in r), "the main process evaluates all of val"
    ev = [*img(shards), "data.batch_size=8", "data.num_workers=0", f"model.checkpoint={tmp_path / 'ft' / 'checkpoint'}",
          "eval.probe_train_samples=48", "eval.probe_epochs=2", "eval.max_eval_samples=16"]
    run([str(ROOT / "pipelines" / "evaluate.py"), *ev, f"run.output={tmp_path / 'ev1'}"], processes=1)
    run([TRACE, "evaluate", *ev, f"run.output={tmp_path / 'ev2'}"], processes=2)
    assert all(t["group_destroyed"] for t in traces(tmp_path / "ev2")), "the rank that exits early leaves it too"
    one, two = (json.loads((tmp_path / f"ev{n}" / "results.json").read_text()) for n in (1, 2))
    assert two["probe_train_samples"] == 48, "the probe reads the whole train split, not rank 0's half"
    assert one == two


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_saved_step(shards, tmp_path, capsys, reference):
    """The ranks agree on the stop (a max over ranks, one step late so that no step waits for its own reduction),
    so rank 1 does not wait in a collective while rank 0 saves: a SIGTERM during step 3 stops every rank after step
    4; a resume on 1 process is refused (:func:`assert_resume_refused`); the resumed 2-process run ends where an
    uninterrupted one does."""
    out = tmp_path / "run"
    stopped = run(mp3_args(shards, out, steps=6), env={"TRACE_SIGTERM": "1:3"}, check=False, timeout=120)
    assert stopped.returncode != 0 and "interrupted by SIGTERM at step 4" in stopped.stderr, stopped.stderr[-2000:]
    assert len([line for line in stopped.stderr.splitlines() if line.startswith("interrupted by SIGTERM")]) == 1, \
        "printed once, by the main process (the launcher's report after it quotes it per rank)"
    ends = traces(out)
    assert len(ends) == 2 and all(t["group_destroyed"] for t in ends), "a stop every rank meets leaves the group"
    trainer = json.loads((state_dir(out) / "trainer.json").read_text())
    assert {k: trainer[k] for k in ("step", "world_size", "global_batch")} == {"step": 4, "world_size": 2,
                                                                                "global_batch": 16}
    assert {p.name for p in state_dir(out).glob("random_states_*.pkl")} == {"random_states_0.pkl",
                                                                            "random_states_1.pkl"}
    assert_resume_refused(mp3_args(shards, out, steps=6)[2:], wrote=2, resumes=1, capsys=capsys)
    run([*mp3_args(shards, out, steps=6), "run.resume=true"])
    straight = reference(mp3_run(shards, steps=6))
    assert same_weights(traces(out)[0]["final"], traces(straight)[0]["final"])
    assert [r["step"] for r in log(out)] == [1, 2, 3, 4, 5, 6]


def assert_resume_refused(args: list[str], wrote: int, resumes: int, capsys) -> None:
    """``pretrain.py args run.resume=true`` on ``resumes`` processes, of a stopped run written by ``wrote``: 2 -> 1
    and 1 -> 2 processes would change the global batch, every rank's place in the data and its random stream:
    refused in one line naming both counts and the launch that continues the run, every file of the run left as it
    is (optimizer.json and config.yaml keep the written run's values, not the refused launch's). Under the launcher
    every rank leaves with exit 2 (the launcher's own code is 1, its report after the line)."""
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("run.output=")))
    before = files_of(out)
    capsys.readouterr()
    if resumes == 1:
        assert pretrain.main([*args, "run.resume=true"]) == 2
        stderr = capsys.readouterr().err
    else:
        result = run([PRETRAIN, *args, "run.resume=true"], check=False)
        assert result.returncode == 1, result.stderr[-2000:]  # (the launcher's code for a failed rank)
        stderr = result.stderr
        assert stderr.startswith("error: ") and "exitcode  : 2 " in stderr and "exitcode  : -15" not in stderr, \
            stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"written by {wrote} process(es) x data.batch_size=8 x run.grad_accum=1 = " \
        f"global batch {8 * wrote}, this launch has {resumes} process(es) x" in errors[0], stderr[-2000:]
    continues = (f"resume with python {Path(PRETRAIN).relative_to(ROOT)} " if wrote == 1 else
                 "resume with ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 "
                 f"{Path(PRETRAIN).relative_to(ROOT)} ")
    assert continues + " ".join(args) + " run.resume=true" in errors[0], errors[0]
    assert files_of(out) == before


def test_a_run_resumes_only_with_the_process_count_that_wrote_it(shards, tmp_path, capsys):
    """1 -> 2 processes refused (:func:`assert_resume_refused`; 2 -> 1: the SIGTERM test's run); the count that
    wrote a run continues it."""
    out = tmp_path / "from1"
    args = ["method=mp3", *img(shards), *TINY, "optim.max_steps=4", f"run.output={out}"]
    with sigterm_at(2):  # stopped as a user does, by SIGTERM
        assert pretrain.main(args) == 143
    assert_resume_refused(args, wrote=1, resumes=2, capsys=capsys)
    assert pretrain.main([*args, "run.resume=true"]) == 0  # the count that wrote it continues it
    assert [r["step"] for r in log(out)] == [1, 2, 3, 4]


def test_two_processes_follow_the_lr_schedule_of_one_at_the_same_global_batch(shards, tmp_path):
    """The lr of every optimizer step, 1 process x batch 64 vs 2 processes x batch 32: the same warm-up + cosine
    trace (a schedule prepared by Accelerate would be stepped once per process: the 2-process run would reach its
    minimum at step 4 of 8), and, as every global batch is the whole 64-sample split (supervised:
    no per-rank randomness), the same weights."""
    common = ["method=supervised", *img(shards), *TINY, "optim.max_steps=8", "optim.lr=1e-3",
              "optim.warmup_fraction=0.25", "optim.min_lr_ratio=0.0", "data.hflip=0", "data.scale=[1.0,1.0]"]
    script = str(ROOT / "pipelines" / "pretrain.py")
    assert pretrain.main([*common, "data.batch_size=64", f"run.output={tmp_path / 'one'}"]) == 0  # 1 process
    run([script, *common, "data.batch_size=32", f"run.output={tmp_path / 'two'}"])
    one, two = ([r["lr"] for r in log(tmp_path / name)] for name in ("one", "two"))
    warmup = [1e-3 * (k + 1) / 2 for k in range(2)]
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * t / 6)) for t in range(6)]
    assert one == pytest.approx([*warmup, *cosine], abs=1e-12), one
    assert two == pytest.approx(one, abs=1e-12), f"2 processes: {two}"
    a, b = (load_file(str(tmp_path / name / "checkpoint" / "model.safetensors")) for name in ("one", "two"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4, "same global batches, same weights"


def test_lr_scaling_follows_the_global_batch_and_is_recorded(shards, tmp_path):
    """``optim.lr_scaling=linear``: the lr tuned at one process's batch (8) doubles on 2 processes (global 16); the
    peak lr, the rule and the global batch are in optimizer.json and the model card. (``sqrt``: sqrt(2)x.)"""
    from patchplace.pipelines.sections import OptimSection

    assert OptimSection(lr=1e-3, lr_scaling="sqrt").scaled_lr(16, default_base=8) == pytest.approx(1e-3 * 2**0.5)
    assert OptimSection(lr=1e-3, lr_scaling="linear", lr_base_batch=256).scaled_lr(2048, 8) == pytest.approx(8e-3)
    assert OptimSection(lr=1e-3).scaled_lr(2048, default_base=8) == 1e-3, "none: the lr as given"
    out = tmp_path / "linear"
    run([str(ROOT / "pipelines" / "pretrain.py"), "method=supervised", *img(shards), *TINY, "optim.max_steps=2",
         "optim.lr=1e-3", "optim.warmup_fraction=0", "optim.min_lr_ratio=1.0", "optim.lr_scaling=linear",
         f"run.output={out}"])
    assert [r["lr"] for r in log(out)] == pytest.approx([2e-3] * 2)
    recorded = json.loads((out / "optimizer.json").read_text())
    assert (recorded["lr"], recorded["lr_scaling"], recorded["global_batch"], recorded["lr_base_batch"]) == (
        pytest.approx(2e-3), "linear", 16, 8)
    card = json.loads((out / "checkpoint" / "config.json").read_text())["metadata"]["recipe"]
    assert card["peak_lr"] == pytest.approx(2e-3) and card["global_batch"] == 16


@pytest.mark.parametrize(("wrote", "resumes"), [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_process_count_at_the_same_global_batch(shards, tmp_path, wrote, resumes):
    """2 processes -> 1 with run.grad_accum=2, and 1 with run.grad_accum=2 -> 2 (global batch 16 throughout): the
    interrupted epoch finishes with exactly the samples the checkpoint's layout had left, step by step, and the
    weights end where an uninterrupted run's do (supervised: no random draws in its step; the two layouts differ
    only in the order of a sum)."""
    accum = {1: "run.grad_accum=2", 2: "run.grad_accum=1"}

    def args(out: Path, processes: int) -> list[str]:
        return [TRACE, "pretrain", "method=supervised", *img(shards), *TINY, "optim.max_steps=3",
                f"run.output={out}", accum[processes]]

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    run(args(straight, wrote), processes=wrote)
    # SIGTERM during the second micro-batch read: one process stops after step 1; two agree after step 2
    stopped = run(args(cut, wrote), processes=wrote, env={"TRACE_SIGTERM": "0:2" if wrote == 1 else "0:1"},
                  check=False)
    at = 1 if wrote == 1 else 2
    assert f"interrupted by SIGTERM at step {at}" in stopped.stderr, stopped.stderr[-2000:]
    resumed = run([*args(cut, resumes), "run.resume=true"], processes=resumes)
    assert f"written by {wrote} process(es) x data.batch_size=8" in resumed.stdout + resumed.stderr
    assert [r["step"] for r in log(cut)] == [1, 2, 3] and log(cut)[-1]["world_size"] == resumes

    def per_step(out: Path, processes: int) -> list[set[str]]:
        """The samples of each optimizer step, over every rank and micro-batch."""
        micro = 2 if processes == 1 else 1
        ranks = [t["keys"] for t in traces(out)[:processes]]  # (a rank of an earlier launch left its trace)
        return [{key for keys in ranks for batch in keys[s * micro:(s + 1) * micro] for key in batch}
                for s in range(len(ranks[0]) // micro)]

    expected = per_step(straight, wrote)
    assert len(expected) == 3 and all(len(step) == 16 for step in expected)
    assert per_step(cut, resumes) == expected[at:], "the rest of the epoch: the same samples, step by step"
    a, b = traces(cut)[0]["final"], traces(straight)[0]["final"]
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_the_lazy_check_names_the_nan_rank_and_every_rank_skips_alike(shards, tmp_path):
    """run.finite_check=lazy on 2 processes: rank 1's inputs are NaN at step 2 (loss and, after the all-reduce,
    every rank's gradients NaN), and at step 3 its loss alone is NaN (the gradients finite). Both steps' updates are
    skipped on both ranks (the skip is a max over ranks; before, rank 0 applied step 3 and the ranks' weights
    parted), and the one line at the next check names rank 1 (before: rank 0, flagged by the NaN gradients)."""
    out = tmp_path / "lazy"
    result = run([*mp3_args(shards, out, steps=6), "run.finite_check=lazy", "optim.fused=true", "run.log_every=4"],
                 env={"TRACE_NANINPUT": "1:2", "TRACE_NANLOSS": "1:3"}, check=False, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: training diverged at step 2: the loss is nan on rank 1 (seen at step 4: run.finite_check=lazy; the "
        "step's update was skipped); nothing of it was saved"), result.stderr[-3000:]
    rank0, rank1 = traces(out)
    assert len(rank0["sums"]) == 4 and rank0["sums"] == rank1["sums"], (rank0["sums"], rank1["sums"])
    assert rank0["sums"][0] == rank0["sums"][1] == rank0["sums"][2] != rank0["sums"][3], "steps 2 and 3 skipped"


def test_a_launch_that_starts_other_processes_than_asked_is_one_line(shards, tmp_path):
    """``accelerate launch --num_processes 2`` without ``--multi_gpu`` starts one process; ``--multi_gpu`` without
    ACCELERATE_USE_CPU on a machine without GPUs starts two that each run alone (before: two runs of one
    run.output, colliding on its lock). Each is refused in one line, the first of the output, naming the command
    that starts two processes; nothing is trained."""
    script = str(ROOT / "pipelines" / "pretrain.py")
    out = tmp_path / "run"
    args = [script, "method=mp3", *img(shards), *TINY, "optim.max_steps=2", f"run.output={out}"]
    cpu = {k: v for k, v in ENV.items() if k != "ACCELERATE_USE_CPU"}
    cases = [(["--num_processes", "2"], ENV, "error: accelerate launch --num_processes 2 started 1 process: without "
              "--multi_gpu, or with --cpu, it runs the script once; start 2 with: ")]
    if not torch.cuda.is_available():
        cases.append((["--multi_gpu", "--num_processes", "2"], cpu, "error: the launcher started 2 processes "
                      "(WORLD_SIZE=2) but --multi_gpu needs GPUs and none is visible (torch.cuda.is_available() is "
                      "False), so each process would train as a run of its own; start them with: "))
    for launch, env, first in cases:
        result = subprocess.run([ACCELERATE, "launch", *launch, "--num_machines", "1", *COMMON, "--main_process_port",
                                 "0", *args], capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 1, result.stderr[-2000:]  # (the launcher's code for a failed process)
        line = result.stderr.splitlines()[0]
        assert line == first + (f"ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 "
                                f"{' '.join(args)} (on CPU; on 2 GPUs the same without ACCELERATE_USE_CPU=true)"), line
        assert [x for x in result.stderr.splitlines() if x.startswith("error:")] == [line]
        assert not (out / "log.jsonl").exists() and not (out / "checkpoints").exists()


def test_rank_streams_never_coincide_across_seeds_and_ranks(shards, tmp_path, mp3_two_process):
    """Rank 0 of seed 1 drew exactly rank 1 of seed 0's masks (seed + rank); now every (seed, rank) pair of a study
    has its own stream, and one process keeps the seed itself."""
    from patchplace.pipelines import engine

    seed1 = tmp_path / "seed1"
    run([*mp3_args(shards, seed1), "run.seed=1"])
    (_, seed0_rank1), (seed1_rank0, _) = traces(mp3_two_process), traces(seed1)
    assert not any(torch.equal(a, b) for a, b in zip(seed1_rank0["masks"], seed0_rank1["masks"], strict=True))

    seeds = {(s, r): engine.rank_seed(s, r) for s in range(2000) for r in range(64)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(engine.rank_seed(s, 0) == s for s in range(2000))
    assert all(0 <= v < 2**32 for v in seeds.values()), "numpy's seed range"


def test_rank_seeds_are_distinct_for_every_accepted_seed_and_rank():
    """rank_seed at its bounds. A map that wraps at 2**31 gives run.seed=2**19 on rank 1 the masks of run.seed=0;
    each accepted (seed, rank) has a seed of its own, (rank - 1, seed) read back from it, below
    2**32 (torch's CPU generator keeps a seed's low 32 bits, numpy takes no more); rank 0 keeps any seed below
    2**31, and seeds of 2**20 or more on several processes, or more than 2048 processes, are refused."""
    from patchplace.pipelines import engine
    from patchplace.pipelines.config import ConfigError
    from patchplace.pipelines.sections import MAX_SEED

    rank_seed, top = engine.rank_seed, engine.SEEDS_PER_RANK - 1
    seeds = [0, 1, 2, 2**19 - 1, 2**19, 2**19 + 1, top - 1, top]
    pairs = {(s, r) for s in seeds for r in range(1, engine.MAX_PROCESSES)} | {
        (s, r) for s in range(4096) for r in range(1, 9)}
    values = {pair: rank_seed(*pair) for pair in pairs}
    assert all(MAX_SEED <= v < 2**32 and divmod(v - MAX_SEED, engine.SEEDS_PER_RANK) == (r - 1, s)
               for (s, r), v in values.items())
    assert len(set(values.values())) == len(pairs)
    assert [rank_seed(s, 0) for s in (0, 2**19, top, 2**20, MAX_SEED - 1)] == [0, 2**19, top, 2**20, MAX_SEED - 1]
    torch.manual_seed(rank_seed(0, 1))
    first = torch.rand(8)
    torch.manual_seed(rank_seed(2**19, 1))
    assert not torch.equal(first, torch.rand(8)), "the streams themselves differ"
    for seed, rank in ((2**20, 1), (MAX_SEED - 1, 1), (0, engine.MAX_PROCESSES)):
        with pytest.raises(ConfigError):
            rank_seed(seed, rank)
    with pytest.raises(ConfigError, match=r"run.seed=1048576 with 2 processes: .*choose run.seed in \[0, 1048576\)"):
        engine.check_seed(2**20, 2)
    engine.check_seed(MAX_SEED - 1, 1)  # one process: any seed
