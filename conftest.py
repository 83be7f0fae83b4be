"""Repository-wide pytest settings."""

import os

# OpenMP threads that wait passively: a test's subprocess that runs both threads (an export, a probe, ONNX Runtime's
# evaluation) beside the other xdist worker's processes yields the cores instead of spinning on them (measured on this
# 2-core machine, a probe on 2 threads beside 2 busy processes: 47 s -> 34 s, as fast as on 1 thread). The wait policy
# changes no thread count and no result; subprocesses inherit it from this environment unless a test sets its own.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # after the wait policy: OpenMP reads it when torch loads it

# Tests run tiny models: one intra-op thread avoids OpenMP spin contention on small CPUs (measured on this 2-core
# machine: 15-20x faster test modules under load). Benchmarks, not tests, measure speed with all threads.
# The pin is for speed, never for a result: every test that trains must learn at any thread count (float rounding,
# and so the trajectory, differs with the thread count and the CPU). PATCHPLACE_TEST_THREADS=2 runs the suite with
# two threads, and `make test` also runs each package's suite from its own folder, where this file is not loaded,
# with the machine's default threads (`make package-tests`).
torch.set_num_threads(int(os.environ.get("PATCHPLACE_TEST_THREADS", "1")))
