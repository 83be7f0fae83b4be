"""Repository-wide pytest settings."""

import torch

# Tests run tiny models: one intra-op thread avoids OpenMP spin contention on small CPUs (measured on this 2-core
# machine: 15-20x faster test modules under load). Benchmarks, not tests, measure speed with all threads.
torch.set_num_threads(1)
