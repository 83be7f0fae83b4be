"""``pipelines/pretrain.py`` on Accelerate's FSDP2 path with CPU processes (gloo), for tests/test_fsdp.py.

Accelerate keeps CPU processes on DDP (it switches to FSDP only for GPU-like devices) and run.fsdp refuses CPUs for
that reason; torch itself shards on CPUs, so this driver switches the built state to FSDP (what Accelerate does on
GPUs) and skips the refusal: the engine's whole FSDP path (prepare, steps, evaluation on every rank, the gathered
backbone folders, save_state / load_state of the full state) then runs as on GPUs. A run without run.fsdp stays on
DDP, as pretrain.py runs it.

Several runs share one launch (the imports and the launcher are most of a small run's cost): their arguments are
separated by ``--then``, each run is ``pretrain.main`` in the same processes one after the other (a fresh Accelerate
state and environment, the process group formed again), and each one's exit code is printed on stdout by rank 0 as
``run <i> exited <code>``. ``run.sigterm_at=N`` among a run's arguments (taken out before pretrain.py reads
them): rank 0 gets SIGTERM during optimizer step N of that run (the ranks agree on the stop, save
and leave with 143, which ends the launch: a stopped run is the last of its launch).

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 tests/fsdp_driver.py <pretrain args> \
        [--then <pretrain args> ...]
"""

from __future__ import annotations

import os
import signal
import sys

from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType

from patchplace.pipelines import engine, pretrain
from patchplace.pipelines.engine import launch

_init = AcceleratorState.__init__
_train_step = engine.Trainer.train_step
SIGTERM_AT = "run.sigterm_at="


def _fsdp_init(self, *args, fsdp_plugin=None, **kwargs) -> None:
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # (later states read it back)


def _sigterm_at(step: int | None) -> None:
    """Rank 0 signalled during optimizer step ``step`` of the next run (``None``: never)."""
    def signalled(trainer, batch, done):
        if step is not None and done + 1 == step and trainer.acc.is_main_process \
                and not getattr(trainer, "_signalled", False):
            trainer._signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return _train_step(trainer, batch, done)

    engine.Trainer.train_step = signalled


def runs(argv: list[str]) -> list[list[str]]:
    """``argv`` split at each ``--then``."""
    out: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            out.append([])
        else:
            out[-1].append(arg)
    return out


def fresh_store(i: int) -> None:
    """Run ``i`` > 0 forms its process group on a TCPStore of its own (the launcher's store still holds the keys of
    the groups before it, which a new group would read): rank 0 picks a free port and hands it to the others through
    the launcher's store."""
    from torch.distributed import TCPStore

    from patchplace.research.benchmarks.fsdp_memory import free_port

    key, rank = f"fsdp_driver/run{i}/port", int(os.environ["RANK"])
    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    if rank == 0:
        agent.set(key, str(free_port()))
    os.environ.update(MASTER_PORT=agent.get(key).decode(), TORCHELASTIC_USE_AGENT_STORE="False")


def main(argv: list[str]) -> int:
    AcceleratorState.__init__ = _fsdp_init
    launch.check_fsdp = lambda run, fine_tunes=False: None
    code, environ = 0, dict(os.environ)
    for i, args in enumerate(runs(argv)):
        os.environ.clear()  # what a run sets (Accelerate's ACCELERATE_USE_FSDP) stays in that run
        os.environ.update(environ)
        if i > 0:
            fresh_store(i)
        at = [a for a in args if a.startswith(SIGTERM_AT)]
        _sigterm_at(int(at[-1][len(SIGTERM_AT):]) if at else None)
        AcceleratorState._reset_state(True)  # the previous run ended its state and its process group
        GradientState._reset_state()
        code = pretrain.main([a for a in args if not a.startswith(SIGTERM_AT)])
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"run {i} exited {code}", flush=True)
        if code != 0:
            break
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
