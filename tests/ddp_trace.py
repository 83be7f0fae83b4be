"""A pipeline (``pretrain`` / ``finetune`` / ``evaluate``) run under ``accelerate launch`` that records, per rank,
what ``test_ddp.py`` checks from outside the processes.

    accelerate launch ... tests/ddp_trace.py pretrain method=mp3 ... run.output=R

writes ``R/trace/rank<r>.pt``: world size and rank, the keys of the samples each optimizer micro-step read, the MP3
permutations each step drew, the number of DDP all-reduce calls (buckets), and the objective's weights before and
after training, and whether the rank destroyed its process group before it returned (one left to the interpreter's
end can abort the process there). Fault injection (the tests of kills and failures): ``TRACE_KILL=<rank>:<step>``
SIGKILLs that rank right after its checkpoint of that step; ``TRACE_RAISE=<rank>:<step>`` raises an error on that
rank at that step; ``TRACE_SIGTERM=<rank>:<step>`` sends SIGTERM to that rank alone during that step;
``TRACE_NANLOSS=<rank>:<step>`` makes the loss run.finite_check=lazy sees on that rank at that step NaN while its
backward stays finite (a NaN that never reaches the gradients); ``TRACE_NANINPUT=<rank>:<step>`` makes that rank's
inputs NaN at that step (loss and gradients NaN). ``sums`` holds the sum of the objective's weights after each
optimizer step. The pipeline itself runs unchanged: this file only wraps engine functions.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import patchplace.objectives.mjp as mjp
import patchplace.objectives.mp3 as mp3
from patchplace.pipelines import engine
from patchplace.pipelines.engine import guards
from patchplace.pipelines.engine import inputs as readers

ROOT = Path(__file__).resolve().parents[1]

TRACE: dict = {"keys": [], "masks": [], "allreduce_calls": 0, "jigsaw": [], "unknown_grad": [], "sums": []}


def _fault(name: str) -> int | None:
    """The step of the fault ``name`` on this rank, or None."""
    spec = os.environ.get(name)
    if not spec:
        return None
    rank, step = (int(v) for v in spec.split(":"))
    return step if rank == PartialState().process_index else None


def _install(pipeline: str) -> None:
    build_data = readers.build_data  # (engine.start reads it from there)

    def traced_build_data(*args, **kwargs):
        data = build_data(*args, **kwargs)
        data.train.return_key = True  # batches become (x, y, keys)
        return data

    if pipeline != "evaluate":  # (its feature extraction reads (x, y) batches; it trains nothing to trace)
        readers.build_data = traced_build_data

    inputs = engine.Trainer._inputs

    def traced_inputs(self, batch):
        TRACE["keys"].append(list(batch[2]))
        if _fault("TRACE_SIGTERM") == len(TRACE["keys"]):  # a real SIGTERM to this rank only
            os.kill(os.getpid(), signal.SIGTERM)
        if _fault("TRACE_RAISE") == len(TRACE["keys"]):
            raise RuntimeError(f"injected failure on rank {PartialState().process_index} at step "
                               f"{len(TRACE['keys'])}")
        x, y = inputs(self, batch)
        return (x * float("nan"), y) if _fault("TRACE_NANINPUT") == len(TRACE["keys"]) else (x, y)

    engine.Trainer._inputs = traced_inputs

    flag = guards.FiniteCheck._flag  # run.finite_check=lazy's flag of a micro-step's loss

    def traced_flag(self, loss, step):
        if _fault("TRACE_NANLOSS") == step:
            loss = torch.full_like(loss, float("nan"))
        return flag(self, loss, step)

    guards.FiniteCheck._flag = traced_flag

    shuffle = mp3.random_shuffle

    def traced_shuffle(*args, **kwargs):
        order = shuffle(*args, **kwargs)
        if torch.is_grad_enabled():  # training draws (pretrain.py's validation runs under no_grad)
            TRACE["masks"].append(order.cpu().clone())
        return order

    mp3.random_shuffle = traced_shuffle

    apply_jigsaw = mjp.MJP.apply_jigsaw

    def traced_apply_jigsaw(self, *args, **kwargs):
        images, unknown_pos = apply_jigsaw(self, *args, **kwargs)
        if torch.is_grad_enabled():  # training steps only (pretrain.py's validation runs under no_grad)
            TRACE["jigsaw"].append(unknown_pos is not None and bool(unknown_pos.any()))  # (the coin's side)
        return images, unknown_pos

    mjp.MJP.apply_jigsaw = traced_apply_jigsaw

    save = engine.Trainer.save_checkpoint

    def traced_save(self, step, **kwargs):
        save(self, step, **kwargs)
        if _fault("TRACE_KILL") == step:
            os.kill(os.getpid(), signal.SIGKILL)

    engine.Trainer.save_checkpoint = traced_save

    fit = engine.Trainer.fit

    def traced_fit(self, batch_size):
        TRACE["initial"] = {k: v.detach().clone() for k, v in self.objective.state_dict().items()}
        prepare = self.acc.prepare

        unknown = self.backbone.unknown_pos_embed

        def traced_prepare(*objects):
            prepared = prepare(*objects)
            for obj in prepared:
                if isinstance(obj, DistributedDataParallel):
                    obj.register_comm_hook(None, counting_allreduce)
                if isinstance(obj, torch.optim.Optimizer) and unknown is not None:  # MJP's E_unk after DDP
                    obj.step = traced_step(obj.step, unknown)
                if isinstance(obj, torch.optim.Optimizer):
                    obj.step = summed_step(obj.step, list(self.objective.parameters()))
            return prepared

        self.acc.prepare = traced_prepare
        result = fit(self, batch_size)
        TRACE["final"] = {k: v.detach().cpu().clone() for k, v in
                          self.acc.unwrap_model(self.objective).state_dict().items()}
        return result

    engine.Trainer.fit = traced_fit


def traced_step(step, unknown: torch.nn.Parameter):
    """``optimizer.step`` that first records E_unk's gradient as DDP left it (None: no rank used it)."""

    def wrapped(*args, **kwargs):
        grad = unknown.grad
        TRACE["unknown_grad"].append(None if grad is None else grad.detach().clone())
        return step(*args, **kwargs)

    return wrapped


def summed_step(step, parameters: list[torch.nn.Parameter]):
    """``optimizer.step`` that then records the sum of the weights (float64: equal weights, equal sums)."""

    def wrapped(*args, **kwargs):
        result = step(*args, **kwargs)
        TRACE["sums"].append(sum(float(p.detach().double().sum()) for p in parameters))
        return result

    return wrapped


def counting_allreduce(state, bucket):
    TRACE["allreduce_calls"] += 1
    return default_hooks.allreduce_hook(state, bucket)


def main() -> int:
    pipeline, *argv = sys.argv[1:]
    _install(pipeline)
    module = importlib.import_module(f"patchplace.pipelines.{pipeline}")
    code = module.main(argv)
    state = PartialState()
    output = next(a.split("=", 1)[1] for a in argv if a.startswith("run.output="))
    out = Path(output) / "trace"
    out.mkdir(parents=True, exist_ok=True)
    torch.save({**TRACE, "rank": state.process_index, "world_size": state.num_processes, "code": code,
                "group_destroyed": not torch.distributed.is_initialized()},
               out / f"rank{state.process_index}.pt")
    return code


if __name__ == "__main__":
    sys.exit(main())
