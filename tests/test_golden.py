"""Golden test of the training engine: the current code trains exactly as the reference commit does.

Every pretraining method, fine-tuning, the streaming path, bf16 and the engine's cadences run a few steps on the
test shards, once with the reference code (``git archive`` of :data:`REFERENCE`) and once with the working tree's,
each in its own process (one process each, CPU, one thread, the same seed and arguments); their run directories
must match file by file: weights, optimizer and RNG states bit-identical, logs and checkpoint metadata equal (timing
fields aside). A run directory the reference code stopped after 2 of 4 steps must resume with the current code to
the weights of an uninterrupted current run. Nothing measured here is stored: the reference is rebuilt from git on
every run, so the comparison holds on any CPU and torch build. A method whose random draws moved by design is
compared with the commit where they moved (:data:`REBASED`, with the reason).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("golden_driver.py")

# The reference: the commit whose pipelines ran from pipelines/core/ as top-level modules, with the engine in one
# file. PATCHPLACE_GOLDEN_REFERENCE=<sha> compares against another commit.
REFERENCE = os.environ.get("PATCHPLACE_GOLDEN_REFERENCE", "e53e835af134bddce31feb52dfcdc1720651cf05")
# Methods whose random draws moved by design after the reference, compared with the commit where they moved (the
# same code then): their masks are drawn on the device inside the step with static shapes, from other ops of the same
# random stream (docs/methods: the GPU step); a draw cannot move without a reference of its own.
# PATCHPLACE_GOLDEN_REBASE=<sha> compares them against another commit.
REBASE = os.environ.get("PATCHPLACE_GOLDEN_REBASE", "1658963c4f7c790ac0383e0fdae3908603894299")
REBASED = {"ijepa": "multi-block masks of one shape per run, drawn on the device (block sizes as the official code)",
           "stop": "I-JEPA's masks, and StoP's noise over the padded targets",
           "randsac": "segments, hierarchy and serialization drawn on the device",
           "mjp": "block-wise masks for the whole batch on the device, the official int(gamma N) count, the coin "
                  "on the device"}
# The tree whose code is compared with the reference: this one, or PATCHPLACE_GOLDEN_TREE (e.g. a perturbed copy, to
# see the test fail).
TREE = Path(os.environ.get("PATCHPLACE_GOLDEN_TREE", ROOT)).resolve()

# The reference's pretrain.METHODS (checked against it below).
METHODS = ("mp3", "mp3_speech", "droppos", "mae", "ijepa", "stop", "randsac", "mjp", "supervised")
# Log fields that measure time, not training.
TIMING = {"startup_s", "data_share", "samples_per_s"}
# Per-step log fields the reference writes and the current code does not (they served benchmarks only): the achieved
# TFLOP/s and the list of ranks that ran (the world size stays in every record).
DROPPED = {"tflops", "ranks"}
# config.yaml fields the reference writes and the current code does not: run.stop_after (a stop for tests only;
# they stop a run by SIGTERM, as a user does).
DROPPED_CONFIG = {"run": ("stop_after",)}
# Top-level module names whose files the drivers report (the code each process imported).
PREFIXES = ["patchplace", "core", "pretrain", "finetune", "reproduction", "benchmarks"]


@dataclass(frozen=True)
class Code:
    """One version of the code: what goes on PYTHONPATH (first) and the modules whose ``main(argv)`` run."""

    name: str
    root: Path
    pythonpath: tuple[Path, ...]
    modules: dict[str, str]  # pipeline (pretrain / finetune) -> module name


def package_sources(root: Path) -> tuple[Path, ...]:
    return (*(root / "packages" / p / "src" for p in ("data", "models", "objectives", "finetune")),
            root / "export" / "src")


def reference_code(root: Path) -> Code:
    """The reference layout: the sub-packages' src dirs, then pipelines/ (its scripts import ``core``)."""
    return Code("reference", root, (*package_sources(root), root / "pipelines"),
                {"pretrain": "pretrain", "finetune": "finetune"})


def rebased_code(root: Path) -> Code:
    """The :data:`REBASE` commit, laid out as the current code."""
    return Code("rebased", root, (*package_sources(root), root / "pipelines" / "src"),
                {"pretrain": "patchplace.pipelines.pretrain", "finetune": "patchplace.pipelines.finetune"})


def method_of(args: list[str]) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith("method=")), None)


def base_of(run: str, runs: dict[str, tuple[str, list[str]]]) -> str:
    """Which code a run is compared with: the reference, or the :data:`REBASE` commit for :data:`REBASED` methods."""
    return "rebased" if method_of(runs[run][1]) in REBASED else "reference"


def current_code() -> Code:
    """How the working tree's code runs: every package's src dir, the pipelines as ``patchplace.pipelines``; the one
    place to adapt when its layout changes."""
    return Code("current", TREE, (*package_sources(TREE), TREE / "pipelines" / "src"),
                {"pretrain": "patchplace.pipelines.pretrain", "finetune": "patchplace.pipelines.finetune"})


# --- the runs -------------------------------------------------------------------------------------------------------

TINY = ["model.preset=vit_micro", "data.batch_size=8", "data.num_workers=0", "run.tensorboard=false",
        "run.log_every=1", "data.shuffle_buffer=16"]
HEADS = {
    "droppos": ["objective.decoder_dim=32", "objective.decoder_heads=2", "objective.decoder_depth=1"],
    "mae": ["objective.decoder_dim=32", "objective.decoder_heads=2", "objective.decoder_depth=1"],
    "randsac": ["objective.decoder_dim=32", "objective.decoder_heads=2", "objective.decoder_depth=1"],
    "ijepa": ["objective.predictor_dim=32", "objective.predictor_heads=2", "objective.predictor_depth=1",
              "objective.min_keep=2"],
    "stop": ["objective.predictor_dim=32", "objective.predictor_heads=2", "objective.predictor_depth=1",
             "objective.min_keep=2"],
    "mjp": ["objective.ratio=0.15"],
}
STREAM = ["data.in_memory=false"]


def data_args(shards: Path, method: str = "mp3") -> list[str]:
    if method == "mp3_speech":
        a = shards / "audio"
        return [f"data.train={a / 'train'}", f"data.val={a / 'validation'}",
                f"data.noise_split={a / 'background_noise'}", "model.preset=audio_mp3"]
    return [f"data.train={shards / 'img' / 'train'}", f"data.val={shards / 'img' / 'test'}"]


def pretrain_args(shards: Path, method: str, *extra: str) -> list[str]:
    # the model preset of data_args (audio) comes after TINY's, so it wins
    return [f"method={method}", *TINY, *data_args(shards, method), *HEADS.get(method, []), *extra]


PRETRAINED = "mp3/checkpoint"  # the checkpoint the fine-tuning runs start from (a run of golden_runs)


def finetune_args(shards: Path, *extra: str) -> list[str]:
    return [*TINY, *data_args(shards), f"model.checkpoint={PRETRAINED}", *extra]


def golden_runs(shards: Path) -> dict[str, tuple[str, list[str]]]:
    """Run name -> (pipeline, arguments without run.output): run by both codes, in this order, compared pairwise."""
    runs = {m: ("pretrain", pretrain_args(shards, m, "optim.max_steps=3")) for m in METHODS}
    runs |= {
        "mp3-streaming": ("pretrain", pretrain_args(shards, "mp3", "optim.max_steps=3", *STREAM)),
        "mp3_speech-streaming": ("pretrain", pretrain_args(shards, "mp3_speech", "optim.max_steps=3", *STREAM)),
        "mae-bf16": ("pretrain", pretrain_args(shards, "mae", "optim.max_steps=3", "run.mixed_precision=bf16")),
        # accumulation, evaluations, intermediate checkpoints, learning-curve snapshots (8 steps an epoch)
        "stop-cadences": ("pretrain", pretrain_args(shards, "stop", "optim.max_steps=4", "run.grad_accum=2",
                                                    "run.eval_every=2", "run.checkpoint_every=2",
                                                    "run.keep_epochs=[0,0.25]")),
        # from the mp3 run's checkpoint: new PE and head, layer decay, Mixup / CutMix, drop path
        "finetune": ("finetune", finetune_args(shards, "optim.max_steps=3")),
        "finetune-streaming": ("finetune", finetune_args(shards, "optim.max_steps=3", *STREAM)),
        "finetune-early-stop": ("finetune", finetune_args(shards, "optim.max_steps=6", "run.eval_every=1",
                                                          "run.early_stop_patience=1")),
    }
    return runs


def resume_runs(shards: Path) -> dict[str, tuple[str, list[str]]]:
    """Runs of 4 steps the reference code stops after 2 and the current code resumes (in memory and streamed)."""
    return {"mp3": ("pretrain", pretrain_args(shards, "mp3", "optim.max_steps=4")),
            "stop-streaming": ("pretrain", pretrain_args(shards, "stop", "optim.max_steps=4", *STREAM))}


# --- running them -------------------------------------------------------------------------------------------------


def environment(code: Code) -> dict[str, str]:
    """One CPU thread, no GPU, the code's own directories first on the path (nothing inherited from the caller)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "PYTHON"))}
    return {**env, "PYTHONPATH": os.pathsep.join(map(str, code.pythonpath)), "PYTHONNOUSERSITE": "1",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}


def launch(code: Code, cwd: Path, runs: dict[str, tuple[str, list[str]]]) -> tuple[subprocess.Popen, Path]:
    """Starts the driver on ``runs`` in ``cwd`` (each run's output: its name, relative); -> the process and its
    report file (driver.log beside it holds the output)."""
    cwd.mkdir(parents=True, exist_ok=True)
    spec = {"modules": code.modules, "prefixes": sorted({*PREFIXES, *(m.split(".")[0] for m in code.modules.values())}),
            "runs": [{"name": n, "script": s, "args": [*a, f"run.output={n}"]} for n, (s, a) in runs.items()],
            "report": str(cwd / "report.json")}
    (cwd / "spec.json").write_text(json.dumps(spec, indent=1))
    with open(cwd / "driver.log", "w") as log:
        process = subprocess.Popen([sys.executable, str(DRIVER), str(cwd / "spec.json")], cwd=cwd, stdout=log,
                                   stderr=subprocess.STDOUT, env=environment(code))
    return process, cwd / "report.json"


def finish(process: subprocess.Popen, report: Path) -> dict:
    try:
        process.wait(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log = (report.parent / "driver.log").read_text(errors="replace")
    assert process.returncode == 0 and report.is_file(), f"driver in {report.parent} failed:\n{log[-5000:]}"
    return json.loads(report.read_text())


@dataclass
class Golden:
    codes: dict[str, Code]
    dirs: dict[str, Path]  # code name -> its runs' working directory
    reports: dict[str, dict]
    resumed: Path  # the reference's stopped runs, resumed there by the current code
    stopped_at: dict[str, list[int]]  # resume run -> the complete checkpoint steps the reference left
    stopped_logs: dict[str, str]  # resume run -> the log.jsonl the reference left


def extracted(commit: str, tmp_path_factory) -> Path:
    """``commit``'s packages/, export/ and pipelines/, extracted from git (skipped where git cannot give them)."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("the golden test rebuilds the reference code from git, and git is not installed")
    if subprocess.run([git, "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True).returncode:
        pytest.skip(f"{ROOT} is not a git checkout: the golden test rebuilds the reference code from its history")
    if subprocess.run([git, "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True).returncode:
        pytest.skip(f"the reference commit {commit} is not in this clone (a shallow clone? fetch main's full "
                    "history, e.g. actions/checkout with fetch-depth: 0)")
    archive = subprocess.run([git, "-C", str(ROOT), "archive", "--format=tar", commit, "packages", "export",
                              "pipelines"], capture_output=True, check=True).stdout
    dest = tmp_path_factory.mktemp("reference")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return dest


@pytest.fixture(scope="session")
def reference_tree(tmp_path_factory) -> Path:
    """The reference commit's code."""
    return extracted(REFERENCE, tmp_path_factory)


@pytest.fixture(scope="session")
def rebased_tree(tmp_path_factory) -> Path:
    """The :data:`REBASE` commit's code."""
    return extracted(REBASE, tmp_path_factory)


@pytest.fixture(scope="module")
def golden(reference_tree, rebased_tree, shards, tmp_path_factory) -> Golden:
    """Both codes run ``golden_runs`` (in parallel); the reference also stops the resume runs after 2 steps and the
    current code runs them straight; then the current code resumes copies of the stopped runs."""
    base = tmp_path_factory.mktemp("golden")
    codes = {"reference": reference_code(reference_tree), "rebased": rebased_code(rebased_tree),
             "current": current_code()}
    dirs = {name: base / name for name in codes}
    runs, resumes = golden_runs(shards), resume_runs(shards)
    cuts = {f"cut-{n}": (s, [*a, "run.stop_after=2"]) for n, (s, a) in resumes.items()}
    bases = {**runs, **cuts}
    started = {
        name: launch(codes[name], dirs[name], {n: r for n, r in bases.items() if base_of(n, bases) == name})
        for name in ("reference", "rebased")}
    started["current"] = launch(codes["current"], dirs["current"],
                                {**runs, **{f"straight-{n}": r for n, r in resumes.items()}})
    reports = {name: finish(*started[name]) for name in codes}
    resumed = base / "resumed"
    resumed.mkdir()
    stopped_at, stopped_logs = {}, {}
    for name in resumes:
        cut = dirs[base_of(f"cut-{name}", bases)] / f"cut-{name}"
        if cut.is_dir():
            shutil.copytree(cut, resumed / f"cut-{name}", symlinks=True)
            stopped_logs[name] = (cut / "log.jsonl").read_text() if (cut / "log.jsonl").is_file() else ""
        stopped_at[name] = complete_steps(resumed / f"cut-{name}")
    reports["resumed"] = finish(*launch(codes["current"], resumed,
                                        {f"cut-{n}": (s, [*a, "run.resume=true"]) for n, (s, a) in resumes.items()}))
    return Golden(codes, dirs, reports, resumed, stopped_at, stopped_logs)


def complete_steps(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if (p / "COMPLETE").is_file())


def outcome(report: dict, run: str, log: Path) -> str | None:
    """None when ``run`` exited 0, else what went wrong (with the end of the driver's output)."""
    result = report["runs"].get(run)
    if result is not None and result["code"] == 0:
        return None
    return f"{run}: {result}\n{log.read_text(errors='replace')[-4000:]}"


# --- comparing run directories ------------------------------------------------------------------------------------


def same_value(a, b, where: str) -> list[str]:
    """Where two loaded values differ: tensors and arrays exactly (dtype, shape, every element), containers item by
    item, numbers exactly."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return [f"{where}: tensor vs {type(b if torch.is_tensor(a) else a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        if torch.equal(a, b):
            return []
        gap = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "-"
        return [f"{where}: values differ (max |a - b| {gap})"]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(np.asarray(a), np.asarray(b)) else [f"{where}: arrays differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"]
        return [d for k in a for d in same_value(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same_value(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    if type(a) is type(b) and a == b:
        return []
    if isinstance(a, str) and isinstance(b, str) and "\n" in a + b:  # text: its first differing line
        pairs = zip_longest(a.splitlines(), b.splitlines(), fillvalue="(end)")
        lines = [(i, x, y) for i, (x, y) in enumerate(pairs, 1) if x != y]
        return [f"{where}: line {lines[0][0]}: {lines[0][1]!r} vs {lines[0][2]!r}" if lines
                else f"{where}: line endings differ"]
    return [f"{where}: {a!r} vs {b!r}"]


def safetensors_of(path: Path) -> dict[str, dict]:
    with safe_open(str(path), framework="pt") as f:
        return {"tensors": {k: f.get_tensor(k) for k in f.keys()}, "metadata": f.metadata() or {}}  # noqa: SIM118


def log_records(text: str) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING | DROPPED} for line in text.splitlines()
            if line]


def substitutions(base: Path) -> dict[str, str]:
    """What text may differ between two runs of the same training, by what it is written as before comparing: the
    runs' working directory, and the sha256 of the pretrained weights a fine-tuning records. That file's bytes vary
    from process to process for the same tensors (safetensors writes its metadata keys in a per-process random
    order); its tensors are compared with the run that wrote it."""
    found = {str(base): "<out>"}
    weights = base / PRETRAINED / "model.safetensors"
    if weights.is_file():
        found[hashlib.sha256(weights.read_bytes()).hexdigest()] = f"<sha256 of {PRETRAINED}/model.safetensors>"
    return found


# What the current code writes beyond the reference, by design (the method registry): a checkpoint's
# metadata records its method's paper for the model card (``paper``; a fine-tune's under ``pretrain_metadata``), and
# the card of an MP3 speech checkpoint cites that paper (the reference's card table had no entry for mp3_speech); the
# precision a run trained in and the processor it detected (``compute``: run.mixed_precision=auto's record); the
# preset the backbone was built from (``preset``: what a command-line model.preset beside a checkpoint is checked by);
# the encoder the checkpoint saved (``encoder``: I-JEPA's / StoP's EMA target encoder, the backbone elsewhere) and a
# speech checkpoint's front end (``frontend``).
# Left out of both sides before comparing; everything else must still match.
ADDED_METADATA = ("paper", "compute", "preset", "encoder", "frontend")
# What a checkpoint's state/trainer.json records beyond the reference: the config it trained with (``config``, which
# a resume checks config.yaml against; its run.output / run.resume differ between a cut and a straight run).
ADDED_TRAINER = ("config", "schedule_start")  # (and the step an optim.extend=phase schedule starts at)
ADDED_CARD_LINE = re.compile(r"^(- \*\*Method\*\*: mp3_speech) — .*$", re.M)
# Config fields added after the reference, with the value that trains as the reference did (off / null): left out of
# config.yaml, the checkpoints' recipe and the model card's recipe table where they hold it (a golden run sets none).
ADDED_CONFIG = {
    "optim": {"optimizer": "adamw", "schedule": "cosine", "warmup_steps": None, "warmup_epochs": None,
              "start_lr": None, "warmup_mode": "linear", "final_lr": None, "step_every": None, "step_gamma": 0.5,
              "weight_decay_end": None, "extend": "replan"},
    "run": {"model_ema": None, "log_with": [], "log_project": "patchplace", "compile_scope": "blocks",
            "activation_checkpointing": False, "fsdp": "off"},
    "finetune": {"pos_embed_init": "random"},
    "objective": {"context_keep": None, "decay_pos_embed": False},
    "data": {"drop_last": True, "re_mode": "const", "re_count": 1, "crop_pct": 1.0, "repeated_aug": 1, "grayscale": 0.0,
             "gaussian_blur": 0.0, "color_jitter": 0.0, "mixup": 0.0, "cutmix": 0.0, "mixup_prob": 1.0,
             "mixup_switch_prob": 0.5, "shard_deadline": 600.0, "frontend": "tf_speech_commands",
             "interpolation": None},
}


# Defaults changed after the reference to a value that trains as the reference's did on the CPU: current -> reference
# (run.finite_check=auto is lazy on a GPU only).
CHANGED_DEFAULTS = {"run": {"finite_check": ("auto", "step")}}
# Records the reference wrote wrongly, training untouched: optimizer.json's lr_base_batch under optim.lr_scaling=none
# (no batch was scaled from: null; the reference wrote the per-process batch), and the fine-tuning pooling MAE and
# DropPos record (main_finetune.py's --global_pool: the mean through a fresh fc_norm; the reference wrote "mean").
CORRECTED_POOL = {"mae": "mean_fc_norm", "droppos": "mean_fc_norm"}


def as_reference_recorded(name: str, data):
    """``data`` (a parsed JSON file of the current code) with the :data:`CORRECTED_POOL` / lr_base_batch records
    written as the reference wrote them."""
    if not isinstance(data, dict):
        return data
    if name.endswith("optimizer.json") and data.get("lr_scaling") == "none" and data.get("lr_base_batch") is None:
        data["lr_base_batch"] = data.get("global_batch", 0) // max(data.get("processes", 1), 1)
    metadata = data.get("metadata")
    for section in (metadata, (metadata or {}).get("pretrain_metadata")):
        if isinstance(section, dict) and section.get("finetune_pool") == CORRECTED_POOL.get(section.get("method")):
            section["finetune_pool"] = "mean"
    return data


def without_added_config(sections: dict) -> dict:
    """``sections`` ({section: {field: value}}: config.yaml, a recipe) without the :data:`ADDED_CONFIG` fields
    that hold their reference-equivalent value, and the :data:`CHANGED_DEFAULTS` as the reference wrote them."""
    for section, changed in CHANGED_DEFAULTS.items():
        values = sections.get(section) if isinstance(sections, dict) else None
        for key, (current, reference) in changed.items():
            if isinstance(values, dict) and values.get(key) == current:
                values[key] = reference
    for section, defaults in ADDED_CONFIG.items():
        values = sections.get(section) if isinstance(sections, dict) else None
        for key, default in defaults.items():
            if isinstance(values, dict) and key in values and values[key] == default:
                del values[key]
    return sections


def without_added_card_rows(text: str) -> str:
    """A model card without the recipe table's rows of :data:`ADDED_CONFIG` fields at their default, and its rows
    of :data:`CHANGED_DEFAULTS` as the reference wrote them."""
    rows = {f"| {section}.{key} | {json.dumps(value)} |" for section, defaults in ADDED_CONFIG.items()
            for key, value in defaults.items()}
    changed = {f"| {section}.{key} | {json.dumps(current)} |": f"| {section}.{key} | {json.dumps(reference)} |"
               for section, fields in CHANGED_DEFAULTS.items() for key, (current, reference) in fields.items()}
    return "\n".join(changed.get(line, line) for line in text.split("\n") if line not in rows)


def objective_in_force(method, given):
    """The objective fields ``method`` trains with: the current code records every one (config.yaml, a checkpoint's
    metadata and recipe, the model card's recipe rows), the reference the given ones; both sides are completed by
    the method's defaults (the config class's, then the registration's) before comparing, as JSON writes them
    (tuples as lists). The config classes' defaults are the reference's
    (:func:`test_the_objective_configs_keep_the_references_defaults`), so completing both sides hides nothing."""
    from patchplace.objectives.declarations import known_methods

    known = known_methods().get(method) if isinstance(method, str) else None
    if known is None or not isinstance(given, dict | None):
        return given
    return json.loads(json.dumps({**known.config_values(), **(given or {})}))


def without_additions(data):
    """``data`` (a parsed config.json) without the keys :data:`ADDED_METADATA` in its metadata and the
    :data:`ADDED_CONFIG` fields at their default in its recipe, its objective fields in force
    (:func:`objective_in_force`)."""
    metadata = data.get("metadata") if isinstance(data, dict) else None
    for section in (metadata, (metadata or {}).get("pretrain_metadata")):
        if isinstance(section, dict):
            for key in ADDED_METADATA:
                section.pop(key, None)
            without_added_config(section.get("recipe"))
            if "objective" in section:
                section["objective"] = objective_in_force(section.get("method"), section["objective"])
                if isinstance(section.get("recipe"), dict):
                    recipe = section["recipe"]
                    recipe["objective"] = objective_in_force(section.get("method"), recipe.get("objective"))
    return data


def loaded(path: Path, base: Path):
    """A run file as its content: tensors, pickled states, parsed JSON / YAML / log records (timing left out), text
    under ``substitutions``; the current code's additions (:data:`ADDED_METADATA`) and the reference's dropped fields
    (:data:`DROPPED`, :data:`DROPPED_CONFIG`) left out."""
    suffix = path.suffix
    if suffix == ".safetensors":
        return safetensors_of(path)
    if suffix in (".bin", ".pkl", ".pt"):
        return torch.load(path, map_location="cpu", weights_only=False)
    text = path.read_text(errors="replace")
    for old, new in substitutions(base).items():
        text = text.replace(old, new)
    if suffix == ".jsonl":
        return log_records(text)
    if suffix == ".json" or path.name == "COMPLETE":
        data = json.loads(text)
        if path.name == "COMPLETE":  # the files it seals (their bytes: compared one by one as content)
            data["files"] = sorted(data["files"])
        if path.name == "trainer.json":
            for key in ADDED_TRAINER:
                data.pop(key, None)
        return without_additions(as_reference_recorded(str(path), data))
    if suffix in (".yaml", ".yml"):
        data = yaml.safe_load(text)
        for section, keys in DROPPED_CONFIG.items():
            for key in keys:
                (data.get(section) or {}).pop(key, None)
        if "objective" in data:
            data["objective"] = objective_in_force(data.get("method"), data["objective"])
        return without_added_config(data)
    if path.name == "README.md":  # (the objective's recipe rows: compared in config.json, in force)
        text = "\n".join(line for line in text.split("\n") if not line.startswith("| objective."))
        return without_added_card_rows(ADDED_CARD_LINE.sub(r"\1", text))
    return text


def run_files(run: Path) -> dict[str, Path]:
    return {str(p.relative_to(run)): p for p in sorted(run.rglob("*"))
            if (p.is_file() or p.is_symlink()) and p.name != ".lock" and "tensorboard" not in p.parts}


def differences(a: Path, b: Path, base_a: Path, base_b: Path, keep: Callable[[str], bool] = lambda _: True,
                ) -> list[str]:
    """How run directory ``b`` differs from ``a``: files present in one only, links, and every kept file's
    content."""
    files_a = {k: v for k, v in run_files(a).items() if keep(k)}
    files_b = {k: v for k, v in run_files(b).items() if keep(k)}
    found = [f"{name}: only in {'the first' if name in files_a else 'the second'}"
             for name in sorted(files_a.keys() ^ files_b.keys())]
    for name in sorted(files_a.keys() & files_b.keys()):
        pa, pb = files_a[name], files_b[name]
        if pa.is_symlink() or pb.is_symlink():
            links = [os.readlink(p) if p.is_symlink() else None for p in (pa, pb)]
            found += [] if links[0] == links[1] else [f"{name}: link {links[0]} vs {links[1]}"]
            continue
        found += same_value(loaded(pa, base_a), loaded(pb, base_b), name)
    return found


def shown(found: list[str], limit: int = 25) -> str:
    return "\n".join(found[:limit] + ([f"... and {len(found) - limit} more"] if len(found) > limit else []))


# --- the tests ----------------------------------------------------------------------------------------------------


def test_each_process_ran_its_own_code(golden):
    """The drivers imported the packages and pipelines of their own tree (PYTHONPATH first, whatever is installed):
    the reference its archive, the current code the working tree; and every reference method is covered."""
    for name, report in (("reference", golden.reports["reference"]), ("rebased", golden.reports["rebased"]),
                         ("current", golden.reports["current"]), ("current", golden.reports["resumed"])):
        root = golden.codes[name].root.resolve()
        modules = report["modules"]
        outside = {m: f for m, f in modules.items() if not Path(f).is_relative_to(root)}
        assert not outside, f"the {name} run imported code from outside {root}: {outside}"
        needed = ["patchplace.data", "patchplace.models", "patchplace.objectives", "patchplace.finetune",
                  *golden.codes[name].modules.values()]
        assert set(needed) <= modules.keys(), f"{name}: not imported: {sorted(set(needed) - modules.keys())}"
    assert "core.engine" in golden.reports["reference"]["modules"], "the reference engine (pipelines/core/) ran"
    assert tuple(golden.reports["reference"]["methods"]) == tuple(sorted(METHODS)), \
        "METHODS must list every pretraining method of the reference"


def test_the_objective_configs_keep_the_references_defaults(golden):
    """Every objective config class of the reference still exists, with the reference's default for each of its
    fields (a changed default that 3 training steps would not show fails here)."""
    reference = golden.reports["reference"]["objective_defaults"]
    current = golden.reports["current"]["objective_defaults"]
    assert reference, "the reference exports no ObjectiveConfig classes to compare defaults with"
    assert set(reference) <= set(current), f"config classes gone: {sorted(set(reference) - set(current))}"
    changed = {f"{cls}.{name}": (value, current[cls].get(name, "(gone)")) for cls, defaults in reference.items()
               for name, value in defaults.items() if current[cls].get(name, "(gone)") != value}
    assert not changed, f"defaults changed since the reference (reference, current): {changed}"


@pytest.mark.parametrize("run", list(golden_runs(Path("shards"))))
def test_the_current_code_trains_bit_identically_to_the_reference(golden, run):
    """Weights (backbone, objective heads, the Accelerate state), optimizer and RNG states bit-identical; the
    training log (timing aside), config.yaml, optimizer.json, checkpoint metadata and model cards equal."""
    base = base_of(run, golden_runs(Path("shards")))  # (the reference, or the commit where the run's draws moved)
    for name in (base, "current"):
        problem = outcome(golden.reports[name], run, golden.dirs[name] / "driver.log")
        assert problem is None, f"the {name} code failed: {problem}"
    ref, cur = golden.dirs[base], golden.dirs["current"]
    found = differences(ref / run, cur / run, ref, cur)
    assert not found, f"{run}: the current code's run differs from the reference's:\n{shown(found)}"


@pytest.mark.parametrize("run", list(resume_runs(Path("shards"))))
def test_a_reference_run_resumes_with_the_current_code(golden, run):
    """A run the reference code left after 2 of 4 steps, resumed by the current code, ends as the current code's
    uninterrupted run: its checkpoints (weights, optimizer, RNG states, metadata) and every logged step."""
    base = "rebased" if method_of(resume_runs(Path("shards"))[run][1]) in REBASED else "reference"
    problem = outcome(golden.reports[base], f"cut-{run}", golden.dirs[base] / "driver.log")
    assert problem is None, f"the {base} code failed: {problem}"
    assert golden.stopped_at[run] == [2], f"the reference left checkpoints {golden.stopped_at[run]}, expected [2]"
    assert [r["step"] for r in log_records(golden.stopped_logs[run]) if "loss" in r] == [1, 2]
    problem = outcome(golden.reports["current"], f"straight-{run}", golden.dirs["current"] / "driver.log")
    assert problem is None, f"the current code failed: {problem}"
    problem = outcome(golden.reports["resumed"], f"cut-{run}", golden.resumed / "driver.log")
    assert problem is None, f"the current code did not resume the reference's run: {problem}"
    straight, resumed = golden.dirs["current"] / f"straight-{run}", golden.resumed / f"cut-{run}"
    # it continued the reference's run: the reference's records of steps 1-2 (timing included) are kept as written
    assert (resumed / "log.jsonl").read_text().startswith(golden.stopped_logs[run]), "the run was not continued"
    found = differences(straight, resumed, golden.dirs["current"], golden.resumed,
                        keep=lambda name: name.startswith(("checkpoint", "log.jsonl")))
    assert not found, f"{run}: resumed from the reference's step 2, it differs from a straight run:\n{shown(found)}"
