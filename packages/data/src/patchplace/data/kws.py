"""Keyword-spotting facts shared by the Speech Commands recipe and the synthesized spoken-keywords corpus.

The 12-class task of the Speech Commands paper (Warden 2018) and TensorFlow's ``speech_commands`` example:
ten keywords plus ``_silence_`` and ``_unknown_`` (every other word), in TensorFlow's label order.
"""

from __future__ import annotations

import hashlib
import os
import re

KEYWORDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
SILENCE = "_silence_"
UNKNOWN = "_unknown_"
BACKGROUND_NOISE_DIR = "_background_noise_"
KWS_CLASSES = (SILENCE, UNKNOWN, *KEYWORDS)

# Speech Commands' auxiliary ("unknown") words: v1 has 20 of them (30 words in all), v2 adds five more.
AUXILIARY_WORDS_V1 = ("bed", "bird", "cat", "dog", "happy", "house", "marvin", "sheila", "tree", "wow",
                      "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
AUXILIARY_WORDS_V2_ONLY = ("backward", "forward", "follow", "learn", "visual")

# From the Speech Commands README: the cap on files per word, which keeps the hash -> set mapping stable
# when files are added later.
MAX_NUM_WAVS_PER_CLASS = 2**27 - 1
SPLITS = ("training", "validation", "testing")


def speaker_id(filename: str | os.PathLike) -> str:
    """The speaker part of a Speech Commands file name: the basename without ``_nohash_...``."""
    return re.sub(r"_nohash_.*$", "", os.path.basename(os.fspath(filename)))


def which_set(filename: str | os.PathLike, validation_percentage: float = 10,
              testing_percentage: float = 10) -> str:
    """``"training"``, ``"validation"`` or ``"testing"`` for a file, by the Speech Commands README's rule.

    The set depends only on the speaker id (sha1 of the basename without ``_nohash_...``), so every file of a
    speaker lands in the same set, and the assignment never changes when files are added.
    """
    digest = hashlib.sha1(speaker_id(filename).encode("utf-8")).hexdigest()
    # Exactly the README's expression (it takes the hash mod MAX + 1 = 2**27 and scales by 100 / MAX).
    percentage_hash = (int(digest, 16) % (MAX_NUM_WAVS_PER_CLASS + 1)) * (100.0 / MAX_NUM_WAVS_PER_CLASS)
    if percentage_hash < validation_percentage:
        return "validation"
    if percentage_hash < validation_percentage + testing_percentage:
        return "testing"
    return "training"
