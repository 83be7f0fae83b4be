"""Repository-wide pytest settings."""

import os

import torch

# Tests run tiny models: one intra-op thread avoids OpenMP spin contention on small CPUs (measured on this 2-core
# machine: 15-20x faster test modules under load). Benchmarks, not tests, measure speed with all threads.
# The pin is for speed, never for a result: every test that trains must learn at any thread count (float rounding,
# and so the trajectory, differs with the thread count and the CPU). PATCHPLACE_TEST_THREADS=2 runs the suite with
# two threads, and `make test` also runs each package's suite from its own folder, where this file is not loaded,
# with the machine's default threads (`make package-tests`).
torch.set_num_threads(int(os.environ.get("PATCHPLACE_TEST_THREADS", "1")))
