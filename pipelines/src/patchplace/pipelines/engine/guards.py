"""What stops a training run early: a non-finite loss or weights (:class:`FiniteCheck`, per step or lazily on the
device), and SIGTERM / SIGINT (:class:`StopSignals`, read at each optimizer step)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from patchplace.pipelines.engine.launch import Diverged


class FiniteCheck:
    """``run.finite_check``: a non-finite loss never reaches the weights, and non-finite weights are never saved.

    ``step``: every micro-step's loss is checked on the host (every rank's gathered: one collective per micro-step,
    so all ranks stop at the same step). ``lazy``: the loss is flagged on the device without a host sync; AdamW's
    fused kernel skips the update of a flagged step (:meth:`before_update`), and :meth:`settle` (one host sync)
    stops the run before anything of a later step is logged, saved or evaluated. ``diverged(step, what)``: the
    message of the :class:`Diverged` raised."""

    def __init__(self, accelerator: Accelerator, mode: str, diverged: Callable[[int, str], str]) -> None:
        self.acc, self.lazy, self.diverged = accelerator, mode == "lazy", diverged
        self._flags: dict[str, torch.Tensor] | None = None

    def loss(self, loss: torch.Tensor, step: int) -> None:
        """The loss of a micro-step of optimizer step ``step`` (1-based), before its backward."""
        if self.lazy:
            self._flag(loss, step)
            return
        losses = self.acc.gather(loss.detach().float().reshape(1)) if self.acc.num_processes > 1 else \
            loss.detach().float().reshape(1)
        bad = (~losses.isfinite()).nonzero().flatten().tolist()
        if bad:
            rank = bad[0]
            raise Diverged(self.diverged(step, f"the loss is {losses[rank].item()} on rank {rank}"))

    def before_update(self, optimizer: Any, grad_norm: torch.Tensor | None, step: int) -> None:
        """On a sync micro-step, before ``optimizer.step()`` (lazy: the fused kernel skips a non-finite update)."""
        if self.lazy:
            self._skip_if_nonfinite(optimizer, grad_norm, step)

    def settle(self, step: int) -> None:
        """Lazy: raise :class:`Diverged` for the first non-finite step so far (``step``: the step that looks)."""
        if self.lazy:
            self._check_flags(step)

    def weights(self, module: nn.Module, step: int) -> None:
        """No checkpoint of non-finite weights (a step with a finite loss can still blow them up)."""
        finite = torch.stack([p.detach().isfinite().all() for p in module.parameters()]).all()
        if not bool(finite):
            raise Diverged(self.diverged(step, "the weights hold non-finite values"))

    def _flag(self, loss: torch.Tensor, step: int) -> None:
        """Every micro-step, no host sync: whether this optimizer step has seen a non-finite loss on this rank, and
        the first such step of the run with its loss (device tensors, read by :meth:`_check_flags`; the gradients'
        flags are set by :meth:`_skip_if_nonfinite`)."""
        value = loss.detach().float()
        bad = ~value.isfinite()
        if self._flags is None:
            self._flags = {"now": torch.zeros((), dtype=torch.bool, device=value.device),
                           "first": torch.full((), -1, dtype=torch.long, device=value.device),
                           "loss": torch.zeros((), device=value.device),
                           "grad_first": torch.full((), -1, dtype=torch.long, device=value.device),
                           "grad": torch.zeros((), device=value.device)}
        flags = self._flags
        fresh = bad & (flags["first"] < 0)
        flags["first"] = torch.where(fresh, flags["first"].new_full((), step), flags["first"])
        flags["loss"] = torch.where(fresh, value, flags["loss"])
        flags["now"] = flags["now"] | bad

    def _skip_if_nonfinite(self, optimizer: Any, grad_norm: torch.Tensor | None, step: int) -> None:
        """On a sync step: AdamW's fused kernel skips this update (``found_inf``) when a loss of the step on any rank
        or the gradients (the same on every rank after the all-reduce) are not finite. The decision is a max over
        ranks (a device all-reduce, no host sync): a loss that is NaN on one rank alone can leave the gradients
        finite, and every rank must skip alike to keep the weights identical."""
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper around the torch optimizer
        if grad_norm is None:
            grads = [p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.acc.device)
        norm = grad_norm.detach().float()
        grad_bad = ~norm.isfinite()
        if self._flags is None:  # (a finite value: sets up the flags only)
            self._flag(torch.zeros((), device=norm.device), step)
        flags = self._flags
        fresh = grad_bad & (flags["grad_first"] < 0)
        flags["grad_first"] = torch.where(fresh, flags["grad_first"].new_full((), step), flags["grad_first"])
        flags["grad"] = torch.where(fresh, norm, flags["grad"])
        skip = (flags["now"] | grad_bad).float()
        if self.acc.num_processes > 1:
            torch.distributed.all_reduce(skip, op=torch.distributed.ReduceOp.MAX)
        inner.found_inf = skip
        flags["now"] = torch.zeros_like(flags["now"])

    def _check_flags(self, step: int) -> None:
        """One host sync (every rank's flags gathered); a non-finite step anywhere stops the run with the same line
        as the per-step check, naming the rank whose loss was not finite (or the gradients, when every rank's loss
        was finite)."""
        if self._flags is None:
            return
        flags = self._flags
        steps = torch.stack([flags["first"], flags["grad_first"]]).reshape(1, 2)
        values = torch.stack([flags["loss"], flags["grad"]]).reshape(1, 2)
        if self.acc.num_processes > 1:
            steps, values = self.acc.gather(steps), self.acc.gather(values)
        steps, values = steps.tolist(), values.tolist()
        losses = [(s, rank) for rank, (s, _) in enumerate(steps) if s >= 0]
        grads = [(s, rank) for rank, (_, s) in enumerate(steps) if s >= 0]
        if not losses and not grads:
            return
        if losses and (not grads or min(losses)[0] <= min(grads)[0]):
            at, rank = min(losses)
            what = f"the loss is {values[rank][0]} on rank {rank}"
        else:
            at, rank = min(grads)
            what = f"the gradients are not finite (norm {values[rank][1]}) while every rank's loss was finite"
        raise Diverged(self.diverged(at, f"{what} (seen at step {step}: run.finite_check=lazy; the step's update "
                                         "was skipped)"))


class StopSignals:
    """SIGTERM / SIGINT set a flag the training loop reads at each optimizer step; a second signal stops at once
    (SIGINT: KeyboardInterrupt; SIGTERM: the default action). Installed only in the main thread; the previous
    handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None  # the last step's reduction, in flight

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # asked twice (e.g. the run is stuck before its next step): stop now
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def drain(self) -> None:
        """Waits for the reduction still in flight (before the process group may be destroyed)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def __exit__(self, *exc: Any) -> None:
        self.drain()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def agreed(self, accelerator: Accelerator) -> int:
        """The signal that asked this run to stop (0: none), agreed by every rank (max over ranks) so that all of
        them save the same step. Under several processes the agreement lags one step: each step starts the
        reduction of what this rank received and reads the previous step's, which has finished by then (the host
        does not wait for the step it just queued), so the step has no host synchronisation of its own."""
        received = self.received or 0
        if accelerator.num_processes == 1:
            return received
        agreed = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = int(flag.item())
        flag = torch.full((1,), received, dtype=torch.int32, device=accelerator.device)
        self._pending = (torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True), flag)
        return agreed
