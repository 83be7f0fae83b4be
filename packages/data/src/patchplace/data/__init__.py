"""patchplace.data — WebDataset shards, image/audio decoding and transforms, the MFCC frontend.

Writing: :class:`SplitWriter` (shards + ``manifest.json``, atomic). Reading: :class:`ShardDataset` +
:func:`make_loader` (deterministic per-epoch shuffles, disjoint rank/worker splits, fixed epoch lengths).
In-memory splits (read once, served by index): :class:`InMemorySplit`, :func:`epoch_indices`.
Transforms: :func:`build_transform`. Speech: :class:`MFCC` (``patchplace.data.mfcc``).
"""

from .codecs import decode_image_bytes, encode_png, encode_wav, read_wav
from .errors import DataError
from .manifest import Manifest, ShardInfo, verify_split
from .memory import InMemorySplit, epoch_indices, fits_in_memory
from .reader import ShardDataset, make_loader
from .transforms import ImageTransform, ImageTransformConfig, build_transform
from .writer import ChannelStats, SplitWriter

__all__ = [
    "ChannelStats", "DataError", "ImageTransform", "ImageTransformConfig", "InMemorySplit", "Manifest", "ShardDataset",
    "ShardInfo", "SplitWriter", "build_transform", "decode_image_bytes", "encode_png", "encode_wav",
    "epoch_indices", "fits_in_memory", "make_loader", "read_wav", "verify_split",
]
