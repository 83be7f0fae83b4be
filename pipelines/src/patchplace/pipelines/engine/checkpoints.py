"""The run directory of a training as one object the Trainer holds (:class:`RunDirectory`; ``rundir.py`` is its
write protocol): the checks before a run starts or resumes, the crash-consistent checkpoints, the backbone folders
kept beside them, and resuming from the newest complete checkpoint. What fills ``snapshots/`` and ``best/`` are the
callbacks of ``callbacks.py``.

Run directory (``run.output``; one run at a time, see ``rundir.py``)::

    config.yaml        the resolved config
    optimizer.json     the peak lr, its scaling, and what every parameter group gets (lr scale, weight decay)
    log.jsonl          one JSON object per logged step / evaluation (main process), each step once
    checkpoints/step-N/  the last complete checkpoint: checkpoint/ (backbone ``save_pretrained`` + objective
                       extras), state/ (Accelerate state + trainer.json, for ``run.resume=true``), COMPLETE
    checkpoint         -> checkpoints/step-N/checkpoint (what fine-tuning, evaluation and export load)
    snapshots/epoch-E/ run.keep_epochs: the backbone folder (as checkpoint/ holds it) after E epochs, metadata with
                       step and epoch (epoch-0: the initial weights)
    best/              run.early_stop_patience: the backbone folder of the best evaluation (metadata: step,
                       best_metric, best_value, metrics); the one to evaluate
    ema/               run.model_ema: the backbone folder of the weights' EMA at the end (metadata: model_ema, the
                       EMA's own evaluation in metrics); its running average: state/model_ema.safetensors
    tensorboard/       TensorBoard event files
    .lock              held while a process runs the directory
"""

from __future__ import annotations

import json
import shutil
import signal
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from safetensors.torch import save_file
from torch import nn

from patchplace.data.atomic import atomic_file, write_json_atomic
from patchplace.models import Backbone, save_pretrained
from patchplace.pipelines.config import ConfigError, to_dict
from patchplace.pipelines.engine.ema import WeightsEma
from patchplace.pipelines.engine.guards import FiniteCheck
from patchplace.pipelines.engine.inputs import metrics_split
from patchplace.pipelines.engine.launch import Interrupted, every_rank, gathered, relaunch
from patchplace.pipelines.engine.logs import Console, JsonlLog, read_log, trackers, truncate_log
from patchplace.pipelines.engine.relayout import Layout, relaid_seed
from patchplace.pipelines.rundir import (
    CheckpointError,
    RunLock,
    clean,
    commit,
    complete_steps,
    disk_error,
    disk_message,
    latest_step,
    load_state_strictly,
    partial_dir,
    point_checkpoint_link,
    prepare_directory,
    publish_folder,
    tidy_folders,
    unsealed_steps,
    verify,
)
from patchplace.pipelines.sections import OptimSection, RunSection


def recipe(config: Any, processes: int) -> dict[str, Any]:
    """The training recipe a checkpoint's model card shows: the optimizer, data and method sections without paths."""
    out: dict[str, Any] = {"processes": processes}
    for section in ("optim", "finetune", "objective"):
        value = getattr(config, section, None)
        if is_dataclass(value):
            out[section] = asdict(value)
        elif isinstance(value, dict) and value:
            out[section] = dict(value)
    data = getattr(config, "data", None)
    if data is not None:
        out["data"] = {k: getattr(data, k) for k in ("batch_size", "img_size", "pad_to", "scale", "hflip", "re_prob",
                                                      "label_fraction") if hasattr(data, k)}
    run = getattr(config, "run", None)
    if run is not None:
        out["run"] = {k: getattr(run, k) for k in ("seed", "mixed_precision", "grad_accum") if hasattr(run, k)}
    return out


def training_metadata(metadata: dict[str, Any], objective: nn.Module, backbone: Backbone, config: Any,
                      processes: int, recorded: dict[str, Any], compute: dict[str, Any]) -> dict[str, Any]:
    """What every backbone folder of a training records: the pipeline's ``metadata``, which pooled feature it
    trained (so probes read that one; docs/design.md), the pooling its method's own fine-tuning protocol uses
    (finetune.global_pool=null reads it), the recipe (``recorded``: what the run adds to it, the global batch and
    the peak lr) and ``compute``: the precision it trained in, and why (run.mixed_precision=auto: what was
    detected)."""
    pool = backbone.config.global_pool
    return {**metadata, "probe_feature": getattr(objective, "probe_feature", pool),
            "finetune_pool": getattr(objective, "finetune_pool", pool),
            "recipe": {**recipe(config, processes), **recorded}, "compute": compute}


def recorded_data(state: Path) -> dict[str, str]:
    """The data fingerprints a checkpoint records (``state/trainer.json``; a checkpoint without them: data.train's
    from its model card, none when that is missing too)."""
    recorded = json.loads((state / "trainer.json").read_text()).get("data")
    if isinstance(recorded, dict):
        return {k: v for k, v in recorded.items() if isinstance(v, str)}
    try:
        card = json.loads((state.parent / "checkpoint" / "config.json").read_text())
        return {"data.train": str(card["metadata"]["data"]["fingerprint"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def recorded_config(state: Path) -> tuple[int, dict[str, Any]] | None:
    """(step, the config the run trained with) a checkpoint records in ``state/trainer.json`` (sealed by its
    ``COMPLETE`` hashes, unlike ``config.yaml``); None for a checkpoint from before it was recorded."""
    trainer = json.loads((state / "trainer.json").read_text())
    return (int(trainer["step"]), trainer["config"]) if isinstance(trainer.get("config"), dict) else None


def snapshot_steps(keep_epochs: tuple[float, ...], per_epoch: int, total: int) -> dict[int, float]:
    """``{step: epoch}`` of ``run.keep_epochs``: epoch e is step ``round(e x per_epoch)`` (0: the initial weights).
    Epochs beyond the run's ``total`` steps, or two epochs on one step, are a :class:`ConfigError` naming them."""
    beyond = [e for e in keep_epochs if round(e * per_epoch) > total]
    if beyond:
        raise ConfigError(f"run.keep_epochs: epoch(s) {', '.join(f'{e:g}' for e in beyond)} lie beyond this run's "
                          f"budget of {total} steps ({total / per_epoch:g} epochs of {per_epoch} steps): drop them, "
                          "or train longer (optim.epochs / optim.max_steps)")
    steps: dict[int, float] = {}
    for e in sorted(keep_epochs):
        step = min(max(round(e * per_epoch), 0), total)
        if step in steps:
            raise ConfigError(f"run.keep_epochs: epochs {steps[step]:g} and {e:g} are both step {step} ({per_epoch} "
                              "steps per epoch): keep one of them")
        steps[step] = e
    return steps


def snapshot_name(epoch: float) -> str:
    return f"snapshots/epoch-{epoch:g}"


def folder_step(folder: Path) -> int | None:
    """The step in the metadata of a backbone folder (``best/``), or None when there is none to read."""
    try:
        return json.loads((folder / "config.json").read_text())["metadata"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def divergence(out: Path, peak_lr: float) -> Callable[[int, str], str]:
    """The message of a diverged step (:class:`~patchplace.pipelines.engine.guards.FiniteCheck`): what of the run
    is kept, and what to change."""
    def message(step: int, what: str) -> str:
        last = latest_step(out)
        kept = (f"the last good checkpoint (step {last}) is kept in {out / 'checkpoints'}" if last is not None
                else "no checkpoint was written")
        return (f"training diverged at step {step}: {what}; nothing of it was saved, {kept}; try a lower optim.lr "
                f"(peak {peak_lr:g}), a longer optim.warmup_fraction, optim.clip_grad, or run.mixed_precision="
                "bf16 / no instead of fp16, in a new run (run.overwrite=true or another run.output)")
    return message


@dataclass
class Saved:
    """What a checkpoint holds of a training: the backbone (``save_pretrained`` with ``metadata``), the objective's
    other parameters (``objective.safetensors``), ``run.model_ema``'s average (or None), and what
    ``state/trainer.json`` records beside the step (the global batch, the data fingerprints)."""

    objective: nn.Module
    backbone: Backbone
    metadata: dict[str, Any]
    ema: WeightsEma | None
    global_batch: int
    fingerprints: dict[str, str]
    # other encoders saved beside the backbone, as folders of each backbone folder (I-JEPA / StoP: the context
    # encoder in checkpoint/context_encoder/, beside the EMA target encoder their papers evaluate)
    others: dict[str, Backbone] = field(default_factory=dict)


class RunDirectory:
    """``run.output`` of one training, held by the :class:`~patchplace.pipelines.engine.trainer.Trainer`: the checks
    before it starts or resumes (:meth:`claim`), the crash-consistent checkpoints (:meth:`save`), the backbone
    folders beside them (:meth:`publish`), the resume (:meth:`resume`) and the records of the run (config.yaml,
    optimizer.json, the evaluations in log.jsonl and the trackers)."""

    def __init__(self, accelerator: Accelerator, run: RunSection, config: Any, saved: Saved, *, log: JsonlLog,
                 finite: FiniteCheck, console: Console, command: str) -> None:
        self.acc, self.run, self.config, self.saved = accelerator, run, config, saved
        self.log, self.finite, self.console, self.command = log, finite, console, command
        self.out = Path(run.output)
        self.stopped_early: dict[str, Any] | None = None  # the early stop a resumed checkpoint records
        self.lock = RunLock(self.out) if accelerator.is_main_process else None
        # optim.extend=phase: the step the schedule's current phase starts at (0: the run's one schedule)
        self.schedule_start = 0
        self.resumed_trainer: dict[str, Any] | None = None  # the resumed checkpoint's trainer.json
        self.resumed_layout: Layout | None = None  # the layout it was written by, where this launch's differs
        # (the resumed checkpoint's trainer.json -> a refusal line or None), e.g. a budget that does not grow
        self.check_resumed: Callable[[dict[str, Any]], str | None] = lambda trainer: None

    # ------------------------------------------------------------------ before training
    def claim(self) -> None:
        """One run per directory: the main process holds run.output's lock until :meth:`release` and, before
        anything is written, checks what the directory holds (:meth:`_check_directory`). A refusal reaches every
        rank (one line, exit 2 everywhere) and leaves every file of the run as it was."""
        refusal: ConfigError | None = None
        if self.lock is not None:
            try:
                self.lock.acquire()
                try:
                    self._check_directory()
                except BaseException:
                    self.lock.release(restore=True)
                    raise
            except ConfigError as exc:
                refusal = exc
        refusal = self._from_main(refusal)
        if refusal is not None:
            raise every_rank(refusal)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def _from_main(self, refusal: ConfigError | None) -> ConfigError | None:
        """The main process's refusal (None: none), on every rank."""
        if self.acc.num_processes == 1:
            return refusal
        shared = broadcast_object_list([None if refusal is None else str(refusal)], from_process=0)
        if shared[0] is None:
            return None
        return refusal if self.acc.is_main_process else ConfigError(shared[0])

    def _check_directory(self) -> None:
        """What run.output holds against run.resume / run.overwrite and the config; on resume, the newest checkpoint
        against this launch: sealed and intact, written by as many processes, trained on the same data (compared by
        fingerprint, wherever the data lie now). Main process, lock held; reads only."""
        run, found, recorded, settings = self.run, None, {}, None
        if run.resume and not run.overwrite:
            found = self._newest_state()
            if found is not None:
                verify(found[1])
                recorded, settings = recorded_data(found[0]), recorded_config(found[0])
        moved = tuple(name for key in recorded for name in (key, f"{key}_urls"))
        prepare_directory(self.out, resume=run.resume, overwrite=run.overwrite, config=to_dict(self.config),
                          moved=moved, recorded=settings)
        if found is not None:
            trainer = json.loads((found[0] / "trainer.json").read_text())
            self._check_processes(found[0], trainer)
            self._check_data(recorded, trainer["step"])
            if problem := self.check_resumed(trainer):
                raise ConfigError(problem)

    def _check_processes(self, state: Path, trainer: dict[str, Any]) -> None:
        """Another process count, per-process batch or run.grad_accum than the checkpoint's continues the run when
        the global batch is kept (:mod:`.relayout`); a changed global batch is refused."""
        saved, now = Layout.of_checkpoint(trainer), self.layout()
        if saved is not None and saved.global_batch == now.global_batch:
            return
        count = trainer.get("world_size") or len(list(state.glob("random_states_*.pkl")))
        if saved is None and count == self.acc.num_processes:
            return
        written = saved.words() if saved is not None else f"{count} process(es)"
        keep = (f"keep data.batch_size x processes x run.grad_accum = {saved.global_batch} (e.g. resume with "
                f"{relaunch(saved.processes, f'{self.command} run.resume=true')})") if saved is not None else \
            f"resume with {relaunch(count, f'{self.command} run.resume=true')}"
        raise CheckpointError(
            f"run.resume=true: the step-{trainer['step']} checkpoint in {self.out} was written by {written}, this "
            f"launch has {now.words()}: the global batch would change what every step averages; {keep}, or start "
            "a new run (another run.output, or run.overwrite=true)")

    def layout(self) -> Layout:
        """This launch's layout of a step's global batch."""
        return Layout(self.acc.num_processes, self.config.data.batch_size, self.run.grad_accum)

    def _check_data(self, recorded: dict[str, str], step: int) -> None:
        for key, fingerprint in recorded.items():
            now = self.saved.fingerprints.get(key)
            if now != fingerprint:
                where = getattr(self.config.data, key.split(".")[1], "?")
                raise ConfigError(
                    f"run.resume=true: {key}={where} holds other data (fingerprint {str(now)[:16]}) than the "
                    f"step-{step} checkpoint in {self.out} was trained on (fingerprint "
                    f"{fingerprint[:16]}): point {key} at that data (its path may change: the fingerprint is "
                    "compared, not the path), or train on this data in a new run (another run.output, or "
                    "run.overwrite=true)")

    def _newest_state(self) -> tuple[Path, Path] | None:
        """(state/, its checkpoint directory) of the newest complete checkpoint, or None when there is none yet. A
        newer ``step-*`` directory without its ``COMPLETE`` record is refused (damage: a save writes ``COMPLETE``
        before the directory gets its name)."""
        steps = complete_steps(self.out)
        newest = steps[-1][0] if steps else -1
        unsealed = [path for number, path in unsealed_steps(self.out) if number > newest]
        if unsealed:
            raise CheckpointError(
                f"{unsealed[-1]} has no {unsealed[-1] / 'COMPLETE'} record, so it cannot be verified (it was removed "
                "or the directory was copied in part): restore the record, or delete that directory to resume from "
                + (f"step {newest}" if steps else "scratch") + ", or start over with run.overwrite=true")
        return (steps[-1][1] / "state", steps[-1][1]) if steps else None

    # ------------------------------------------------------------------ writes
    def save(self, step: int, metrics: dict[str, Any] | None = None, records: dict[str, Any] | None = None) -> None:
        """Crash-consistent (``rundir.py``): write ``checkpoints/.partial-step-N`` (backbone + objective extras,
        Accelerate state with every rank's RNG), seal it with ``COMPLETE``, rename it to ``step-N``, point the
        ``checkpoint`` link at it, then remove the previous step. ``metrics`` (the end-of-run evaluation) go into
        the model card and config.json *before* the seal: nothing rewrites a sealed checkpoint; ``records`` (the
        callbacks' ``on_end``: the early stop's summary) go into ``state/trainer.json``. Weights that are not
        finite are never saved (:class:`Diverged`); a full disk is a one-line error."""
        acc, out, saved = self.acc, self.out, self.saved
        self.finite.weights(saved.objective, step)
        partial = partial_dir(out, step)
        acc.wait_for_everyone()
        metadata = {**saved.metadata, "step": step, **({"metrics": metrics, "metrics_split": metrics_split(
            self.config.data)} if metrics else {})}
        try:
            if acc.is_main_process:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
            acc.wait_for_everyone()
            exported = gathered(acc, saved)  # every rank: run.fsdp gathers the full weights (a collective)
            if acc.is_main_process:
                self.save_backbone(partial / "checkpoint", metadata, exported)
            acc.save_state(str(partial / "state"))  # every process writes its own random_states_<rank>.pkl
            if acc.is_main_process and saved.ema is not None:  # run.model_ema's average (the same on every rank)
                saved.ema.save_state(partial / "state")
            acc.wait_for_everyone()  # ... before the main process seals the directory
            if acc.is_main_process:
                self._seal(partial, step, records or {})
        except Exception as exc:  # OSError, torch's RuntimeError, SafetensorError: only disk errors are caught
            if not disk_error(exc):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(disk_message(out, step, exc)) from None
        acc.wait_for_everyone()

    def _seal(self, partial: Path, step: int, records: dict[str, Any]) -> None:
        """``state/trainer.json``, then the seal, the rename, the link and the previous step's removal."""
        (partial / "state" / "trainer.json").write_text(json.dumps({
            "step": step, "world_size": self.acc.num_processes, "global_batch": self.saved.global_batch,
            "data": self.saved.fingerprints, **records, "schedule_start": self.schedule_start,
            "config": to_dict(self.config)}))  # what a resume checks config.yaml against
        final = commit(partial, step)
        point_checkpoint_link(self.out, final / "checkpoint")
        clean(self.out, keep=final)

    def save_backbone(self, folder: Path, metadata: dict[str, Any], saved: Saved | None = None) -> None:
        """The backbone checkpoint folder (``save_pretrained`` + the objective's extra parameters in
        ``objective.safetensors``): what ``checkpoint/``, ``snapshots/*`` and ``best/`` hold, of ``saved`` (default:
        the run's; under run.fsdp, :func:`~patchplace.pipelines.engine.launch.gathered`'s). Main process."""
        saved = saved or self.saved
        save_pretrained(saved.backbone, folder, metadata=metadata)
        for name, other in saved.others.items():
            save_pretrained(other, folder / name, metadata={**metadata, "encoder": name})
        extras = {k: v.detach().contiguous().cpu() for k, v in self.acc.unwrap_model(saved.objective)
                  .state_dict().items() if not k.startswith(("backbone.", "target_encoder."))}
        if extras:
            save_file(extras, str(folder / "objective.safetensors"))

    def publish(self, name: str, step: int, metadata: dict[str, Any], missing_only: bool = False) -> bool:
        """The backbone of ``step`` as the folder ``name`` (``snapshots/epoch-E``, ``best``), replaced whole
        (``metadata`` added to the training's). Every rank calls this (the finite check); the main process writes,
        unless ``missing_only`` and the folder is there already. True: it was written."""
        self.finite.weights(self.saved.objective, step)
        exported = gathered(self.acc, self.saved)  # every rank (run.fsdp: a collective)
        if not self.acc.is_main_process or (missing_only and (self.out / name).is_dir()):
            return False
        publish_folder(self.out / name, lambda folder: self.save_backbone(
            folder, {**self.saved.metadata, "step": step, **metadata}, exported))
        return True

    def record_run(self, plan: Any, optim: OptimSection, groups: Any) -> None:
        """``optimizer.json`` (the peak lr, its scaling, and ``groups``: what every parameter really gets) and
        ``config.yaml``, written by the main process once the resume is accepted: a refused one leaves the run's
        files alone."""
        if self.acc.is_main_process:
            write_json_atomic(self.out / "optimizer.json", {
                "lr": plan.peak_lr, "config_lr": optim.lr, "lr_scaling": optim.lr_scaling,
                "lr_base_batch": plan.lr_base_batch, "global_batch": plan.global_batch,
                "processes": self.acc.num_processes, "layer_decay": optim.layer_decay,
                "weight_decay": optim.weight_decay, "parameters": groups})
            history = self.config_history()
            with atomic_file(self.out / "config.yaml") as tmp:
                tmp.write_text("".join(f"{line}\n" for line in history) + yaml.safe_dump(to_dict(self.config),
                                                                                            sort_keys=False))

    def config_history(self) -> list[str]:
        """config.yaml's history: the comment lines of the extensions before (kept) and this session's, if it
        extends the budget the resumed checkpoint was trained for."""
        path, lines = self.out / "config.yaml", []
        if path.is_file():
            lines = [line for line in path.read_text().splitlines() if line.startswith("# extended at step ")]
        old = (self.resumed_trainer or {}).get("config", {}).get("optim", {})
        new = to_dict(self.config).get("optim", {})
        changed = [f"optim.{key} {old[key]!r} -> {new[key]!r}" for key in ("epochs", "max_steps")
                   if key in old and old[key] != new.get(key)]
        if changed:
            step = self.resumed_trainer["step"]
            lines.append(f"# extended at step {step}: {', '.join(changed)} (optim.extend={new.get('extend')})")
        return lines

    def record_eval(self, step: int, result: dict[str, Any], key: str = "eval", prefix: str = "val/") -> None:
        """An evaluation of ``step`` in log.jsonl (under ``key``) and the trackers (``prefix``: val/top1, ...).
        Main process."""
        self.log.write({"step": step, key: result})
        if trackers(self.run):  # beside train/*
            self.acc.log({f"{prefix}{k}": v for k, v in result.items() if isinstance(v, int | float)
                          and k != "count"}, step=step)

    # ------------------------------------------------------------------ resume
    def resume_step(self) -> int:
        """``run.resume=true``: load the newest complete checkpoint (0: none yet), which the main process checked
        in :meth:`claim` (sealed, intact, as many processes, the same data). A state file the safe loader refuses
        or cannot read is refused in one line (Accelerate would skip a bad random state)."""
        if not self.run.resume:
            return 0
        found = self._newest_state()
        if found is None:
            self.acc.print(f"run.resume=true: {self.out} holds no checkpoint yet; starting at step 0")
            return 0
        state = found[0]
        trainer = json.loads((state / "trainer.json").read_text())
        self.stopped_early = trainer.get("stopped_early")
        self.resumed_trainer = trainer
        self.schedule_start = int(trainer.get("schedule_start", 0))
        saved = Layout.of_checkpoint(trainer)
        if saved is not None and saved != self.layout():  # another layout: the random streams restart
            self.resumed_layout = saved
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.acc.load_state(str(state))  # (a rank the checkpoint had no random state for is fine here)
            set_seed(relaid_seed(self.run.seed, self.acc.process_index, int(trainer["step"])))
            self.acc.print(f"run.resume=true: the step-{trainer['step']} checkpoint was written by "
                           f"{saved.words()}; continuing with {self.layout().words()} (the interrupted epoch "
                           "finishes with its samples; each rank's random stream restarts)")
        else:
            load_state_strictly(self.acc, state)
        if self.saved.ema is not None:
            self.saved.ema.load_state(state)
        return int(trainer["step"])

    def resume(self) -> int:
        """The step this session starts at (:meth:`resume_step`), with the run directory made whole for it: what a
        kill in a snapshot / best/ write left is removed and the log is cut back to that step (the later steps are
        logged again). What the callbacks kept of that step is theirs to restore (``on_start``)."""
        step = self.resume_step()
        if self.acc.is_main_process:
            for parent in (self.out, self.out / "snapshots"):  # what a kill in a snapshot / best/ write left
                tidy_folders(parent)
            if self.run.resume:
                truncate_log(self.out / "log.jsonl", step)  # the steps after the checkpoint are logged again
        return step

    def records(self) -> list[dict[str, Any]]:
        """log.jsonl's records (main process; none elsewhere or before the first)."""
        path = self.out / "log.jsonl"
        return read_log(path)[0] if self.acc.is_main_process and path.is_file() else []

    def finish_resumed(self, step: int, total: int) -> dict[str, Any]:
        """A resumed run that had finished (``step`` of ``total``, or stopped early): nothing to train, nothing to
        rewrite, only what a kill in its last save left undone (the link, the old step). Returns its last
        evaluation (the last in its log)."""
        if self.acc.is_main_process:
            final = complete_steps(self.out)[-1][1]
            point_checkpoint_link(self.out, final / "checkpoint")
            clean(self.out, keep=final)
        how = f"stopped early at step {step} of {total}" if self.stopped_early else f"step {step} of {total}"
        self.acc.print(f"run.resume=true: {self.out} is complete ({how}); nothing to do")
        evals = [r["eval"] for r in self.records() if isinstance(r.get("eval"), dict)]
        return evals[-1] if evals else {}

    def interrupted(self, step: int, signum: int) -> Interrupted:
        """The stop a signal asked for, after the checkpoint of ``step``: how to resume (exit 128 + signal)."""
        name = signal.Signals(signum).name
        launcher = "python" if self.acc.num_processes == 1 else "accelerate launch <the same launch options>"
        return Interrupted(f"interrupted by {name} at step {step}: checkpoint saved in {self.out}/checkpoints; "
                           f"resume with: {launcher} {self.command} run.resume=true", 128 + signum)
