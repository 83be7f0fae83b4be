"""``evaluate.main`` with a fault, for the tests of what a stopped or failed evaluation leaves behind (run as
``accelerate launch ... tests/evaluate_fault_driver.py <evaluate.py args>``): ``EVAL_SIGTERM_RANK=<r>`` sends
SIGTERM to rank ``r`` as soon as it has written its first batch of features; ``EVAL_OWN_OUTPUT_RANK=<r>`` gives
rank ``r`` a run.output of its own (``<run.output>-rank<r>``), as a run.output that is not one folder every machine
shares."""

from __future__ import annotations

import os
import signal
import sys

from patchplace.finetune import FeatureWriter
from patchplace.pipelines import evaluate

RANK = os.environ.get("RANK", "0")


def stop_after_first_batch() -> None:
    append = FeatureWriter.append

    def append_then_stop(self, *args, **kwargs) -> None:
        append(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    FeatureWriter.append = append_then_stop


if __name__ == "__main__":
    argv = sys.argv[1:]
    if os.environ.get("EVAL_SIGTERM_RANK") == RANK:
        stop_after_first_batch()
    if os.environ.get("EVAL_OWN_OUTPUT_RANK") == RANK:
        argv = [f"{a}-rank{RANK}" if a.startswith("run.output=") else a for a in argv]
    sys.exit(evaluate.main(argv))
