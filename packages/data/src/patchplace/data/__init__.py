"""patchplace.data — WebDataset shards, image/audio decoding and transforms, the MFCC frontend.

Writing: :class:`SplitWriter` (shards + ``manifest.json``, atomic). Reading: :class:`ShardDataset` +
:func:`make_loader` (deterministic per-epoch shuffles, disjoint rank/worker splits, fixed epoch lengths).
In-memory splits (read once, served by index): :class:`InMemorySplit`, :func:`epoch_indices`.
Transforms: :func:`build_transform`. Speech: :class:`MFCC` (``patchplace.data.mfcc``).
"""

from importlib import import_module
from typing import Any

# name -> the module that defines it, imported on first use (PEP 562): ``python -m patchplace.data --help`` and the
# config's checks read manifests without importing torch (reader, memory and transforms import it)
_EXPORTS = {
    "decode_image_bytes": "codecs", "encode_png": "codecs", "encode_wav": "codecs", "read_wav": "codecs",
    "DataError": "errors", "Manifest": "manifest", "ShardInfo": "manifest", "verify_split": "manifest",
    "InMemorySplit": "memory", "epoch_indices": "memory", "fits_in_memory": "memory", "ShardDataset": "reader",
    "make_loader": "reader", "ImageTransform": "transforms", "ImageTransformConfig": "transforms",
    "build_transform": "transforms", "ChannelStats": "writer", "SplitWriter": "writer",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ChannelStats", "DataError", "ImageTransform", "ImageTransformConfig", "InMemorySplit", "Manifest", "ShardDataset",
    "ShardInfo", "SplitWriter", "build_transform", "decode_image_bytes", "encode_png", "encode_wav",
    "epoch_indices", "fits_in_memory", "make_loader", "read_wav", "verify_split",
]
