"""Repository-wide pytest settings."""

import os

import torch

# Tests run tiny models: one intra-op thread avoids OpenMP spin contention on small CPUs (measured on this 2-core
# machine: 15-20x faster test modules under load). Benchmarks, not tests, measure speed with all threads.
# PATCHPLACE_TEST_THREADS=2 runs the suite with two threads: every test that trains must learn with 1 and with 2
# (float rounding, and so the trajectory, differs with the thread count and the CPU).
torch.set_num_threads(int(os.environ.get("PATCHPLACE_TEST_THREADS", "1")))
