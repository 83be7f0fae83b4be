"""``pipelines/pretrain.py`` on Accelerate's FSDP2 path with CPU processes (gloo), for tests/test_fsdp.py.

Accelerate keeps CPU processes on DDP (it switches to FSDP only for GPU-like devices) and run.fsdp refuses CPUs for
that reason; torch itself shards on CPUs, so this driver switches the built state to FSDP (what Accelerate does on
GPUs) and skips the refusal: the engine's whole FSDP path (prepare, steps, evaluation on every rank, the gathered
backbone folders, save_state / load_state of the full state) then runs as on GPUs. ``FSDP_SIGTERM_AT=N``: rank 0
gets SIGTERM during optimizer step N (the ranks agree on the stop, save and exit 143).

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 tests/fsdp_driver.py <pretrain args>
"""

from __future__ import annotations

import os
import signal
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from patchplace.pipelines import engine, pretrain
from patchplace.pipelines.engine import launch

_init = AcceleratorState.__init__


def _fsdp_init(self, *args, fsdp_plugin=None, **kwargs) -> None:
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # (later states read it back)


def _sigterm_at(step: int) -> None:
    train_step = engine.Trainer.train_step

    def signalled(trainer, batch, done):
        if done + 1 == step and trainer.acc.is_main_process and not getattr(trainer, "_signalled", False):
            trainer._signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(trainer, batch, done)

    engine.Trainer.train_step = signalled


if __name__ == "__main__":
    AcceleratorState.__init__ = _fsdp_init
    launch.check_fsdp = lambda run, fine_tunes=False: None
    if os.environ.get("FSDP_SIGTERM_AT"):
        _sigterm_at(int(os.environ["FSDP_SIGTERM_AT"]))
    sys.exit(pretrain.main(sys.argv[1:]))
