"""The checkpoints of a training, over every rank: what one holds (:class:`Saved`), writing one
(:meth:`Checkpoints.save`, through the crash-consistent protocol of ``protocol.py``), the backbone folders kept
beside them (:meth:`Checkpoints.publish`), reading one back (:meth:`Checkpoints.load`) and what every backbone
folder's metadata records (:func:`training_metadata`). The run directory
(:class:`~patchplace.pipelines.engine.rundir.RunDir`) holds one :class:`Checkpoints`.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch import nn

from patchplace.models import Backbone, save_pretrained
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine.ema import WeightsEma
from patchplace.pipelines.engine.guards import FiniteCheck
from patchplace.pipelines.engine.inputs import metrics_split
from patchplace.pipelines.engine.launch import gathered
from patchplace.pipelines.engine.protocol import (
    CheckpointError,
    clean,
    commit,
    disk_error,
    disk_message,
    latest_step,
    partial_dir,
    point_checkpoint_link,
    publish_folder,
)
from patchplace.pipelines.engine.relayout import Layout, relaid_seed


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


def load_state_strictly(accelerator: Any, state: Path) -> None:
    """``accelerator.load_state(state)``, but a file it cannot read is a one-line :class:`CheckpointError` naming
    it, never a traceback: this rank's random state is read first by the same safe loader (Accelerate skips a bad
    one with ``except Exception``, and the resumed run would silently draw other masks), and a file the safe
    (``weights_only``) loader refuses is named as not written by this run, without torch's advice to turn the
    safety off."""
    own = state / f"random_states_{accelerator.process_index}.pkl"
    try:
        states = _safe_load(own)
        if not isinstance(states, dict) or not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= set(
                states):
            raise ValueError("it lacks the python / numpy / torch random states")
    except Exception as exc:
        raise CheckpointError(_unloadable(own, exc)) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accelerator.load_state(str(state))
    except Exception as exc:
        bad = next((p for p in sorted(state.iterdir()) if p.suffix in (".bin", ".pkl") and not _loads(p)), state)
        raise CheckpointError(_unloadable(bad, exc)) from None


def _safe_load(path: Path) -> Any:
    """Accelerate's loader (torch's ``weights_only`` one, numpy allowed), its pickle-protocol warnings silenced."""
    from accelerate.utils import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(path, map_location="cpu")


def _loads(path: Path) -> bool:
    try:
        _safe_load(path)
    except Exception:
        return False
    return True


def _unloadable(path: Path, exc: BaseException) -> str:
    text = str(exc)
    if "Weights only load failed" in text:  # torch's long advice (to turn the safety off) is never repeated
        after = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        detail = after[0].strip() if after and "WeightsUnpickler error:" in text else "not plain tensors"
        why = (f"the safe (weights-only) loader refuses it ({detail}), so it is not a file this run wrote "
               "(damaged, replaced or tampered with); it was not run")
    else:
        first = text.strip().splitlines()[0][:160] if text.strip() else ""
        why = f"it cannot be read ({type(exc).__name__}: {first})"
    return (f"checkpoint file {path} cannot be loaded: {why}; the run cannot resume exactly from it: restore the "
            "file, delete that checkpoint directory to resume from an earlier one, or start over with "
            "run.overwrite=true")


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


class Checkpoints:
    """The checkpoints in ``out`` of the training ``saved`` describes, written and read by every rank (the main
    process writes the shared files, each rank its own random state)."""

    def __init__(self, accelerator: Accelerator, out: Path, config: Any, saved: Saved, finite: FiniteCheck) -> None:
        self.acc, self.out, self.config, self.saved, self.finite = accelerator, out, config, saved, finite

    def save(self, step: int, record: dict[str, Any], metrics: dict[str, Any] | None = None) -> None:
        """Crash-consistent (``protocol.py``): write ``checkpoints/.partial-step-N`` (backbone + objective extras,
        Accelerate state with every rank's RNG), seal it with ``COMPLETE``, rename it to ``step-N``, point the
        ``checkpoint`` link at it, then remove the previous step. ``metrics`` (the end-of-run evaluation) go into
        the model card and config.json *before* the seal: nothing rewrites a sealed checkpoint; ``record`` is
        ``state/trainer.json``. Weights that are not finite are never saved (:class:`Diverged`); a full disk is a
        one-line error."""
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
                self._seal(partial, step, record)
        except Exception as exc:  # OSError, torch's RuntimeError, SafetensorError: only disk errors are caught
            if not disk_error(exc):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(disk_message(out, step, exc)) from None
        acc.wait_for_everyone()

    def _seal(self, partial: Path, step: int, record: dict[str, Any]) -> None:
        """``state/trainer.json``, then the seal, the rename, the link and the previous step's removal."""
        (partial / "state" / "trainer.json").write_text(json.dumps(record))
        self.settle(commit(partial, step))

    def settle(self, final: Path) -> None:
        """The ``checkpoint`` link pointed at the sealed ``final``, every other step removed (main process)."""
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

    def load(self, state: Path, trainer: dict[str, Any], now: Layout, seed: int) -> Layout | None:
        """Every rank's state from ``state`` (``trainer``: its trainer.json), and run.model_ema's average. Written
        by another layout than ``now`` (returned; None: the same), the random streams restart from (``seed``, rank,
        step); else a file the safe loader refuses or cannot read is refused in one line (Accelerate would skip a
        bad random state)."""
        saved = Layout.of_checkpoint(trainer)
        relaid = saved if saved is not None and saved != now else None
        if relaid is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.acc.load_state(str(state))  # (a rank the checkpoint had no random state for is fine here)
            set_seed(relaid_seed(seed, self.acc.process_index, int(trainer["step"])))
            self.acc.print(f"run.resume=true: the step-{trainer['step']} checkpoint was written by "
                           f"{relaid.words()}; continuing with {now.words()} (the interrupted epoch finishes with "
                           "its samples; each rank's random stream restarts)")
        else:
            load_state_strictly(self.acc, state)
        if self.saved.ema is not None:
            self.saved.ema.load_state(state)
        return relaid
