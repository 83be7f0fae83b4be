"""The run directory of a training (with ``rundir.py``, its write protocol): the checks before a run starts or
resumes, the crash-consistent checkpoints, the backbone folders kept beside them, and resuming from the newest
complete checkpoint.

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
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from accelerate.utils import broadcast_object_list
from safetensors.torch import save_file

from patchplace.data.atomic import atomic_file, write_json_atomic
from patchplace.models import save_pretrained
from patchplace.pipelines.config import ConfigError, to_dict
from patchplace.pipelines.engine.inputs import metrics_split
from patchplace.pipelines.engine.launch import relaunch
from patchplace.pipelines.engine.logs import read_log, truncate_log
from patchplace.pipelines.rundir import (
    CheckpointError,
    clean,
    commit,
    complete_steps,
    disk_error,
    disk_message,
    load_state_strictly,
    partial_dir,
    point_checkpoint_link,
    prepare_directory,
    publish_folder,
    tidy_folders,
    unsealed_steps,
    verify,
)


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


class Checkpointing:
    """The :class:`~patchplace.pipelines.engine.trainer.Trainer`'s run directory: what it checks before training,
    the checkpoints and backbone folders it writes, and the resume. Reads the Trainer's ``acc``, ``out``, ``run``,
    ``config``, ``command``, ``metadata``, ``backbone``, ``objective``, ``global_batch``, ``fingerprints``,
    ``snapshots``, ``tracker``, ``stopped_early``, ``log``, ``finite``, ``bar`` and ``ema`` (run.model_ema or
    None)."""

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
        if found is None:
            return
        state = found[0]
        trainer = json.loads((state / "trainer.json").read_text())
        saved = trainer.get("world_size") or len(list(state.glob("random_states_*.pkl")))
        if saved != self.acc.num_processes:
            raise CheckpointError(
                f"run.resume=true: the step-{trainer['step']} checkpoint in {self.out} was written by {saved} "
                f"process(es), this launch has {self.acc.num_processes}: the global batch, each rank's place in the "
                f"data and its random stream would change; resume with "
                f"{relaunch(saved, f'{self.command} run.resume=true')}, or start a new run (another run.output, or "
                "run.overwrite=true)")
        for key, fingerprint in recorded.items():
            now = self.fingerprints.get(key)
            if now != fingerprint:
                where = getattr(self.config.data, key.split(".")[1], "?")
                raise ConfigError(
                    f"run.resume=true: {key}={where} holds other data (fingerprint {str(now)[:16]}) than the "
                    f"step-{trainer['step']} checkpoint in {self.out} was trained on (fingerprint "
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

    def save_checkpoint(self, step: int, metrics: dict[str, Any] | None = None,
                        stopped_early: dict[str, Any] | None = None) -> None:
        """Crash-consistent (``rundir.py``): write ``checkpoints/.partial-step-N`` (backbone + objective extras,
        Accelerate state with every rank's RNG), seal it with ``COMPLETE``, rename it to ``step-N``, point the
        ``checkpoint`` link at it, then remove the previous step. ``metrics`` (the end-of-run evaluation) go into
        the model card and config.json *before* the seal: nothing rewrites a sealed checkpoint; ``stopped_early``
        (the early stop's summary) goes into ``state/trainer.json``. Weights that are not finite are never saved
        (:class:`Diverged`); a full disk is a one-line error."""
        acc, out = self.acc, self.out
        self.finite.weights(self.objective, step)
        partial = partial_dir(out, step)
        acc.wait_for_everyone()
        metadata = {**self.metadata, "step": step, **({"metrics": metrics, "metrics_split": metrics_split(
            self.config.data)} if metrics else {})}
        try:
            if acc.is_main_process:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
            acc.wait_for_everyone()
            if acc.is_main_process:
                self._save_backbone(partial / "checkpoint", metadata)
            acc.save_state(str(partial / "state"))  # every process writes its own random_states_<rank>.pkl
            if acc.is_main_process and self.ema is not None:  # run.model_ema's average (the same on every rank)
                self.ema.save_state(partial / "state")
            acc.wait_for_everyone()  # ... before the main process seals the directory
            if acc.is_main_process:
                (partial / "state" / "trainer.json").write_text(json.dumps({
                    "step": step, "world_size": acc.num_processes, "global_batch": self.global_batch,
                    "data": self.fingerprints, **({"stopped_early": stopped_early} if stopped_early else {}),
                    "config": to_dict(self.config)}))  # what a resume checks config.yaml against
                final = commit(partial, step)
                point_checkpoint_link(out, final / "checkpoint")
                clean(out, keep=final)
        except Exception as exc:  # OSError, torch's RuntimeError, SafetensorError: only disk errors are caught
            if not disk_error(exc):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(disk_message(out, step, exc)) from None
        acc.wait_for_everyone()

    def _save_backbone(self, folder: Path, metadata: dict[str, Any]) -> None:
        """The backbone checkpoint folder (``save_pretrained`` + the objective's extra parameters in
        ``objective.safetensors``): what ``checkpoint/``, ``snapshots/*`` and ``best/`` hold. Main process."""
        save_pretrained(self.backbone, folder, metadata=metadata)
        extras = {k: v.detach().contiguous().cpu() for k, v in self.acc.unwrap_model(self.objective)
                  .state_dict().items() if not k.startswith(("backbone.", "target_encoder."))}
        if extras:
            save_file(extras, str(folder / "objective.safetensors"))

    def _snapshot(self, step: int, missing_only: bool = False) -> None:
        """Keep the backbone of ``step`` (a run.keep_epochs step) in ``snapshots/epoch-E/`` (every rank calls
        this; the main process writes). ``missing_only``: unless it is there already (the step a run starts at)."""
        self.finite.weights(self.objective, step)
        epoch = self.snapshots[step]
        name = snapshot_name(epoch)
        if not self.acc.is_main_process or (missing_only and (self.out / name).is_dir()):
            return
        publish_folder(self.out / name, lambda folder: self._save_backbone(
            folder, {**self.metadata, "step": step, "epoch": epoch}))
        self.log.write({"step": step, "snapshot": name})
        self._print(f"snapshot: epoch {epoch:g} (step {step}) in {self.out / name}")

    def _save_best(self, step: int) -> None:
        """Write ``best/``: the backbone of ``step``, the best evaluation so far (every rank calls this; the main
        process writes). Called after the checkpoint of that step, so a run resumed from it can rewrite it."""
        self.finite.weights(self.objective, step)
        tracker = self.tracker
        if not self.acc.is_main_process or tracker is None:
            return
        metrics = {k: v for k, v in tracker.best_eval.items() if isinstance(v, int | float | str)}
        publish_folder(self.out / "best", lambda folder: self._save_backbone(folder, {
            **self.metadata, "step": step, "best_metric": tracker.metric, "best_value": tracker.best,
            "metrics": metrics, "metrics_split": metrics_split(self.config.data)}))

    def _catch_up(self, step: int) -> None:
        """What a kill may have left unwritten of the step this run starts at (its weights are loaded): its
        snapshot (step 0: the initial weights) and ``best/`` when that step is the best. Older ones are on disk
        (a snapshot step is a checkpoint step, written before its checkpoint; best/ right after its checkpoint)."""
        if step in self.snapshots:
            self._snapshot(step, missing_only=True)
        tracker = self.tracker
        if not self.acc.is_main_process or tracker is None or tracker.best_step is None:
            return
        if folder_step(self.out / "best") != tracker.best_step:
            if tracker.best_step == step:
                self._save_best(step)
            else:
                print(f"warning: {self.out / 'best'} does not hold the best step ({tracker.best_step}) of the log, "
                      "whose weights are gone (was it changed by hand?); it is rewritten at the next better "
                      "evaluation", file=sys.stderr)

    def _print(self, text: str) -> None:
        """A line of the main process, clear of the progress bar."""
        if self.acc.is_main_process:
            (self.bar.write if getattr(self, "bar", None) is not None else print)(text)

    def _report_best(self) -> None:
        tracker = self.tracker
        if tracker is not None and tracker.best_step is not None:
            self._print(f"best: {self.out / 'best'} (step {tracker.best_step}, {tracker.metric} {tracker.best:.4g}): "
                        "the checkpoint to evaluate")

    def resume_step(self) -> int:
        """``run.resume=true``: load the newest complete checkpoint (0: none yet), which the main process checked
        when the Trainer was made (:meth:`_check_directory`: sealed, intact, as many processes, the same data). A
        state file the safe loader refuses or cannot read is refused in one line (Accelerate would skip a bad
        random state)."""
        if not self.run.resume:
            return 0
        found = self._newest_state()
        if found is None:
            self.acc.print(f"run.resume=true: {self.out} holds no checkpoint yet; starting at step 0")
            return 0
        state = found[0]
        trainer = json.loads((state / "trainer.json").read_text())
        self.stopped_early = trainer.get("stopped_early")
        load_state_strictly(self.acc, state)
        if self.ema is not None:
            self.ema.load_state(state)
        return int(trainer["step"])

    def _resume(self) -> int:
        """The step this session starts at (:meth:`resume_step`), with the run directory made whole for it: what a
        kill in a snapshot / best/ write left is removed, the log is cut back to that step (the later steps are
        logged again), early stopping's state replays the log's evaluations up to it, and that step's snapshot and
        best/ are written where a kill left them unwritten."""
        step = self.resume_step()
        if self.acc.is_main_process:
            for parent in (self.out, self.out / "snapshots"):  # what a kill in a snapshot / best/ write left
                tidy_folders(parent)
            if self.run.resume:
                truncate_log(self.out / "log.jsonl", step)  # the steps after the checkpoint are logged again
                log = self.out / "log.jsonl"
                if self.tracker is not None and log.is_file():  # early stopping: the evaluations up to the checkpoint
                    self.tracker.replay(read_log(log)[0])
        self._catch_up(step)
        return step

    def _finished(self, step: int, total: int) -> dict[str, Any]:
        """A resumed run that had finished (``step`` of ``total``, or stopped early): nothing to train, nothing to
        rewrite, only what a kill in its last save left undone (the link, the old step). Returns its last
        evaluation."""
        if self.acc.is_main_process:
            final = complete_steps(self.out)[-1][1]
            point_checkpoint_link(self.out, final / "checkpoint")
            clean(self.out, keep=final)
        how = f"stopped early at step {step} of {total}" if self.stopped_early else f"step {step} of {total}"
        self.acc.print(f"run.resume=true: {self.out} is complete ({how}); nothing to do")
        self._report_best()
        return self._finished_result()

    def _record_run(self, optimizer: dict[str, Any]) -> None:
        """``optimizer.json`` (``optimizer``: what every parameter really gets) and ``config.yaml``, written by the
        main process once the resume is accepted: a refused one leaves the run's files alone."""
        if self.acc.is_main_process:
            write_json_atomic(self.out / "optimizer.json", optimizer)
            with atomic_file(self.out / "config.yaml") as tmp:
                tmp.write_text(yaml.safe_dump(to_dict(self.config), sort_keys=False))

    def _finished_result(self) -> dict[str, Any]:
        """What a finished run measured at its end (the last evaluation in its log), for a resumed finished run."""
        path = self.out / "log.jsonl"
        records = read_log(path)[0] if self.acc.is_main_process and path.is_file() else []
        evals = [r["eval"] for r in records if isinstance(r.get("eval"), dict)]
        return evals[-1] if evals else {}
