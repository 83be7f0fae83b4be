"""The pipelines' streamed loaders pin their batches exactly when the training device is CUDA (a fake accelerator
stands in for one: no GPU is needed to check how the loaders are built)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import patchplace.data.reader as reader_module
from patchplace.data import ShardDataset, make_loader
from patchplace.pipelines import engine
from patchplace.pipelines.sections import DataSection


def _accelerator(device: str) -> SimpleNamespace:
    """What build_data reads of an Accelerator: its device, rank, world size and print."""
    return SimpleNamespace(device=torch.device(device), process_index=0, num_processes=1,
                           print=lambda *args, **kwargs: None)


@pytest.mark.parametrize(("device", "pinned"), [("cuda", True), ("cuda:1", True), ("cpu", False), ("meta", False)])
def test_streamed_loaders_pin_memory_exactly_on_cuda(shards, monkeypatch, device, pinned):
    built: list[bool] = []
    real = reader_module.DataLoader

    def recording(*args, **kwargs):
        built.append(kwargs["pin_memory"])
        return real(*args, **{**kwargs, "pin_memory": False})  # pinning itself needs a GPU

    monkeypatch.setattr(reader_module, "DataLoader", recording)
    cfg = DataSection(train=str(shards / "img" / "train"), val=str(shards / "img" / "test"), num_workers=0,
                      in_memory=False)
    data = engine.build_data(cfg, _accelerator(device), seed=0)
    assert isinstance(data.train, ShardDataset) and isinstance(data.val, ShardDataset)
    for reader in (data.train, data.val):
        assert reader.pin_memory is pinned
        x, _ = next(iter(reader.batches(8, epoch=0)))
        assert x.shape[0] == 8
    make_loader(data.val, 8)
    make_loader(data.val, 8, pin_memory=False)  # an explicit choice wins over the dataset's
    assert built == [pinned, pinned, pinned, False]


def test_readers_built_outside_the_pipelines_do_not_pin(shards):
    assert ShardDataset(shards / "img" / "test").pin_memory is False
    assert make_loader(ShardDataset(shards / "img" / "test"), 8).pin_memory is False
