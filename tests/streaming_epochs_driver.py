"""Run under ``accelerate launch`` (or plainly, one process): read ``epochs`` epochs of a streamed split the way the
trainer does (:meth:`ShardDataset.batches`, rank and world size from Accelerate) and write, per rank,
``out/rank<r>.json``: ``{"keys": [[epoch's sample keys]], "sizes": [[epoch's batch sizes]], "dropped": n}``. Several
reads share one launch (the imports and the launcher are most of its cost): one group of 6 arguments each.

    accelerate launch ... tests/streaming_epochs_driver.py SPLIT OUT WORKERS BATCH DROP_LAST EPOCHS [SPLIT OUT ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accelerate import PartialState

from patchplace.data import ShardDataset


def read(state: PartialState, split: str, out: str, workers: str, batch: str, drop_last: str, epochs: str) -> None:
    ds = ShardDataset(split, shuffle_buffer=16, seed=0, rank=state.process_index, world_size=state.num_processes,
                      num_workers=int(workers), return_key=True, batch_size=int(batch), drop_last=drop_last == "1")
    keys, sizes = [], []
    for epoch in range(int(epochs)):
        keys.append([k for _, _, ks in ds.batches(int(batch), epoch) for k in ks])
        sizes.append([len(ks) for _, _, ks in ds.batches(int(batch), epoch)])
    Path(out).mkdir(parents=True, exist_ok=True)
    record = {"keys": keys, "sizes": sizes, "dropped": ds.dropped(int(batch)), "batches": ds.num_batches(int(batch))}
    (Path(out) / f"rank{state.process_index}.json").write_text(json.dumps(record))


def main() -> None:
    args = sys.argv[1:]
    if not args or len(args) % 6:
        sys.exit(f"usage: {__doc__.strip().splitlines()[-1].strip()}")
    state = PartialState(cpu=True)  # CPU processes (gloo): the reader needs only rank and world size
    for i in range(0, len(args), 6):
        read(state, *args[i:i + 6])


if __name__ == "__main__":
    main()
