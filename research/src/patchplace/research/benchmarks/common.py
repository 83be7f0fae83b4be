"""What the suites share: the study's model and loader sizes, the device, a preset's image setting."""

from __future__ import annotations

import argparse

import torch

from patchplace.models import PRESETS
from patchplace.research.benchmarks.options import STUDY as STUDY  # stated with the command line (no torch)


def device_of(args: argparse.Namespace) -> str:
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def image_setting(preset: str, img_size: int | None, in_chans: int | None, widths: str | None
                  ) -> tuple[int, int, str]:
    """Image size, channels and decoder widths: the 32 px presets default to the study (1 channel, study widths),
    others to their own size and channels with the papers' widths."""
    config = PRESETS[preset]
    small = (img_size or config.img_size) <= 32
    return (img_size or config.img_size, in_chans or (1 if small else config.in_chans),
            widths or ("study" if small else "paper"))
