"""The papers' step schedules (``optim.*``): the warm-up length, the lr factor and the weight decay of optimizer step
``step`` (0-based), each a pure function of the step, so nothing is checkpointed and a resumed run sets the same
values (:class:`~patchplace.pipelines.engine.optim.StepSchedule` applies them before every optimizer step).

* Warm-up: ``optim.warmup_steps`` > ``optim.warmup_epochs`` > ``optim.warmup_fraction`` (the first one set wins).
  Linear from ``optim.start_lr`` (timm ``CosineLRScheduler``'s ``warmup_lr_init``: the first step trains at it), or
  constant at ``optim.start_lr`` (``warmup_mode=constant``: "Position Prediction as an Effective Pretraining
  Strategy", arXiv 2207.07611, §4.3: 500 steps at 1e-4, then 1e-3). ``start_lr`` null: the (k + 1) / W ramp.
* After it: cosine to ``optim.final_lr`` (else lr x ``min_lr_ratio``; timm's ``lr_min``), a step decay (x
  ``step_gamma`` every ``step_every`` steps from the warm-up's end, torch's ``StepLR``) or the constant peak.
* Weight decay: I-JEPA / StoP's ``CosineWDSchedule`` ("Self-Supervised Learning from Images with a Joint-Embedding
  Predictive Architecture", arXiv 2301.08243, src/utils/schedulers.py) from ``optim.weight_decay`` to
  ``optim.weight_decay_end``.

``start_lr`` and ``final_lr`` are absolute lrs (as I-JEPA's configs give them): ``optim.lr_scaling`` rescales the
peak only. A group with a layer-decay ``lr_scale`` gets them x its scale, as timm's schedulers do.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from patchplace.pipelines.sections import OptimSection


def warmup_length(cfg: OptimSection, per_epoch: int, total: int) -> int:
    """Warm-up optimizer steps: ``warmup_steps``, else ``round(warmup_epochs x per_epoch)``, else
    ``round(warmup_fraction x total)``."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    if cfg.warmup_epochs is not None:
        return round(cfg.warmup_epochs * per_epoch)
    return round(cfg.warmup_fraction * total)


def lr_factor(cfg: OptimSection, total: int, warmup: int, peak_lr: float) -> Callable[[int], float]:
    """The lr of 0-based optimizer step ``step`` as a factor of the peak lr ``peak_lr`` (the groups' lr x it). With
    every new knob off it is :func:`~patchplace.pipelines.engine.optim.warmup_cosine`'s, float for float."""
    start = None if cfg.start_lr is None else cfg.start_lr / peak_lr
    floor = cfg.min_lr_ratio if cfg.final_lr is None else cfg.final_lr / peak_lr

    def warming(step: int) -> float:
        if start is None:  # the default ramp: peak / W at the first step, the peak at the W-th
            return (step + 1) / warmup
        if cfg.warmup_mode == "constant":
            return start
        return start + (1 - start) * step / warmup  # timm: warmup_lr_init + t (lr - warmup_lr_init) / warmup_t

    def after(step: int) -> float:
        if cfg.schedule == "constant":
            return 1.0
        if cfg.schedule == "step":
            return cfg.step_gamma ** ((step - warmup) // cfg.step_every)
        t = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    def factor(step: int) -> float:
        return warming(step) if step < warmup else after(step)

    return factor


def cosine_weight_decay(total: int, start: float, end: float) -> Callable[[int], float]:
    """I-JEPA's ``CosineWDSchedule``: stepped before optimizer step ``step`` (0-based), its counter is ``step + 1``,
    so the last step trains at ``end`` exactly: ``end + (start - end) x 0.5 (1 + cos(pi (step + 1) / total))``,
    held at ``end`` beyond (its clamp)."""

    def decay(step: int) -> float:
        progress = min((step + 1) / total, 1.0)
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return decay


def weight_decay_schedule(cfg: OptimSection, total: int) -> Callable[[int], float] | None:
    """``optim.weight_decay_end``'s cosine, or None (a constant weight decay: the groups are never touched)."""
    if cfg.weight_decay_end is None:
        return None
    return cosine_weight_decay(total, cfg.weight_decay, cfg.weight_decay_end)


def schedule_words(cfg: OptimSection, warmup: int, total: int) -> str:
    """The schedule in words, for the line a run prints at its start (``warm-up 500 steps, then step ...``)."""
    start = "" if cfg.start_lr is None else f" from {cfg.start_lr:g}" if cfg.warmup_mode == "linear" \
        else f" at {cfg.start_lr:g}"
    after = {"cosine": f"cosine to {cfg.final_lr:g}" if cfg.final_lr is not None
             else f"cosine to lr x {cfg.min_lr_ratio:g}",
             "step": f"x {cfg.step_gamma:g} every {cfg.step_every} steps", "constant": "constant"}[cfg.schedule]
    wd = "" if cfg.weight_decay_end is None else \
        f"; weight decay cosine {cfg.weight_decay:g} -> {cfg.weight_decay_end:g}"
    return f"warm-up {warmup} steps ({cfg.warmup_mode}{start}), then {after}, {total} steps in all{wd}"
