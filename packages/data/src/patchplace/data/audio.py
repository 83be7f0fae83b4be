"""Clip-level audio transforms of the keyword-spotting recipe (fixed 1 s clips, time shift, background noise).

MP3's speech experiments (§4.3) train "with exactly the same experimental setting" as TC-ResNet (Choi et al., 2019),
whose data path is TensorFlow's ``speech_commands`` example (``input_data.py``): every clip is brought to 1 s,
shifted in time by up to +-100 ms with zero fill, mixed with a random stretch of a random ``_background_noise_``
file at volume ~ U(0, 0.1) with probability 0.8, and clamped to [-1, 1]. Those defaults are the ones below.

Randomness: every random draw goes through a ``torch.Generator``. The one passed to ``__call__`` wins; otherwise
the object's own generator (created from ``seed`` in the constructor) is used; with neither, torch's global RNG is
used — which is what a multi-worker ``DataLoader`` seeds differently per worker, so leave ``seed=None`` there (a
seeded object is copied into every worker and all workers would then draw the same stream).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .errors import DataError

_FIX_MODES = ("center", "random", "start")


def _as_wave(wave: torch.Tensor | np.ndarray, what: str) -> torch.Tensor:
    """A 1-D float32 tensor view/copy of ``wave``, or a DataError naming ``what``."""
    if isinstance(wave, np.ndarray):
        if not (np.issubdtype(wave.dtype, np.floating) or np.issubdtype(wave.dtype, np.integer)):
            raise DataError(f"{what}: expected a float waveform, got numpy dtype {wave.dtype}")
        if np.issubdtype(wave.dtype, np.integer):
            raise DataError(f"{what}: expected a float waveform in [-1, 1], got integer PCM ({wave.dtype}); "
                            "decode it with patchplace.data.codecs.read_wav or divide by 32768")
        # A copy: arrays from soundfile / np.load may be read-only, which torch.from_numpy warns about.
        wave = torch.from_numpy(np.array(wave, dtype=np.float32, copy=True))
    elif isinstance(wave, torch.Tensor):
        if not wave.is_floating_point():
            raise DataError(f"{what}: expected a float waveform in [-1, 1], got {wave.dtype}; "
                            "convert PCM with wave.float() / 32768")
        wave = wave.to(torch.float32)
    else:
        raise DataError(f"{what}: expected a 1-D torch.Tensor or numpy array, got {type(wave).__name__}")
    if wave.dim() != 1:
        raise DataError(f"{what}: expected a mono 1-D waveform, got shape {tuple(wave.shape)}; downmix first")
    return wave


def _randint(low: int, high: int, generator: torch.Generator | None) -> int:
    """Uniform integer in [low, high] (both inclusive)."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def _uniform(high: float, generator: torch.Generator | None) -> float:
    """Uniform float in [0, high)."""
    return float(torch.rand((), generator=generator)) * high


def _check_length(length: object, what: str) -> int:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length <= 0:
        raise DataError(f"{what} must be a positive int number of samples, got {length!r}")
    return int(length)


def fix_length(
    wave: torch.Tensor | np.ndarray,
    length: int = 16000,
    mode: str = "center",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Zero-pad or crop a mono clip to exactly ``length`` samples; returns a new float32 1-D tensor.

    ``mode`` places the clip inside the window (when padding) or the window inside the clip (when cropping):
    ``"center"`` (evaluation: deterministic, keeps the middle of long clips), ``"random"`` (training: a uniform
    offset drawn from ``generator``, or torch's global RNG when None), ``"start"`` (keep the beginning / pad at the
    end, as TensorFlow's ``decode_wav(desired_samples=...)`` does in the speech_commands example).
    """
    length = _check_length(length, "fix_length length")
    if mode not in _FIX_MODES:
        raise DataError(f"fix_length mode must be one of {_FIX_MODES}, got {mode!r}")
    wave = _as_wave(wave, "fix_length wave")
    n = wave.shape[0]
    if n == length:
        return wave.clone()
    slack = abs(n - length)
    if mode == "center":
        offset = slack // 2
    elif mode == "random":
        offset = _randint(0, slack, generator)
    else:
        offset = 0
    if n > length:
        return wave[offset : offset + length].clone()
    out = wave.new_zeros(length)
    out[offset : offset + n] = wave
    return out


class AudioAugment:
    """Training-time augmentation of a fixed-length clip: zero-filled time shift, background noise, clamp.

    TensorFlow speech_commands / TC-ResNet recipe (which MP3 §4.3 follows), per clip:

    1. shift by ``s`` samples, ``s`` uniform in [-time_shift, +time_shift] (both ends included;
       ``time_shift = round(time_shift_ms * sample_rate / 1000)``); ``s > 0`` delays the content; vacated samples
       are zeros (not circular);
    2. with probability ``noise_prob``: pick a clip of ``noise_bank`` uniformly, a uniform offset into it, and add
       that stretch times a volume ~ U(0, ``noise_volume``). Noise clips **shorter** than the input are tiled
       (repeated end to end) rather than rejected — TensorFlow raises instead, but a short synthetic noise file
       should not stop training; noise clips at least as long are never wrapped;
    3. clamp to [-1, 1].

    With an empty ``noise_bank`` step 2 is skipped. TensorFlow's silence-class handling (foreground volume 0) is
    label-dependent and left to the caller. Randomness: see the module docstring — a generator passed to
    ``__call__`` wins over the one made from ``seed`` here, which wins over torch's global RNG.

    Usage::

        noise = [read_wav(p) for p in sorted(Path("_background_noise_").glob("*.wav"))]
        augment = AudioAugment(noise_bank=noise, seed=0)
        wave = augment(fix_length(read_wav("yes/0a7c2a8d_nohash_0.wav"), 16000, "random"))
    """

    def __init__(
        self,
        noise_bank: Sequence[np.ndarray | torch.Tensor] = (),
        time_shift_ms: float = 100.0,
        noise_prob: float = 0.8,
        noise_volume: float = 0.1,
        sample_rate: int = 16000,
        seed: int | None = None,
    ) -> None:
        self.sample_rate = _check_length(sample_rate, "AudioAugment sample_rate")
        if not float(time_shift_ms) >= 0.0:
            raise DataError(f"AudioAugment time_shift_ms must be >= 0, got {time_shift_ms!r}")
        if not 0.0 <= float(noise_prob) <= 1.0:
            raise DataError(f"AudioAugment noise_prob is a probability in [0, 1], got {noise_prob!r}")
        if not float(noise_volume) >= 0.0:
            raise DataError(f"AudioAugment noise_volume must be >= 0, got {noise_volume!r}")
        self.time_shift_ms = float(time_shift_ms)
        self.time_shift = round(self.time_shift_ms * self.sample_rate / 1000.0)
        self.noise_prob = float(noise_prob)
        self.noise_volume = float(noise_volume)
        if isinstance(noise_bank, (np.ndarray, torch.Tensor)):
            raise DataError("AudioAugment noise_bank must be a list of 1-D noise clips, got a single array; "
                            "wrap it in a list")
        self.noise_bank = [_as_wave(clip, f"AudioAugment noise_bank[{i}]") for i, clip in enumerate(noise_bank)]
        for i, clip in enumerate(self.noise_bank):
            if clip.numel() == 0:
                raise DataError(f"AudioAugment noise_bank[{i}] is empty; drop it from the noise bank")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise DataError(f"AudioAugment seed must be an int or None, got {seed!r}")
        self.generator = None if seed is None else torch.Generator().manual_seed(int(seed))

    def __repr__(self) -> str:
        return (f"AudioAugment(time_shift_ms={self.time_shift_ms}, noise_prob={self.noise_prob}, "
                f"noise_volume={self.noise_volume}, noise_clips={len(self.noise_bank)}, "
                f"sample_rate={self.sample_rate}, seeded={self.generator is not None})")

    def _noise_segment(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        clip = self.noise_bank[_randint(0, len(self.noise_bank) - 1, generator)]
        if clip.shape[0] >= n:
            offset = _randint(0, clip.shape[0] - n, generator)
            return clip[offset : offset + n]
        # Shorter than the input: tile from a random phase so the repetition does not always start at 0.
        offset = _randint(0, clip.shape[0] - 1, generator)
        return clip[(offset + torch.arange(n)) % clip.shape[0]]

    def __call__(self, wave: torch.Tensor | np.ndarray, generator: torch.Generator | None = None) -> torch.Tensor:
        """Augment one 1-D clip; returns a new float32 tensor of the same length, in [-1, 1]."""
        wave = _as_wave(wave, "AudioAugment wave")
        gen = generator if generator is not None else self.generator
        n = wave.shape[0]
        out = torch.zeros_like(wave)
        shift = _randint(-self.time_shift, self.time_shift, gen) if self.time_shift > 0 else 0
        shift = max(-n, min(n, shift))  # a shift longer than the clip leaves silence, not an index error
        if shift >= 0:
            out[shift:] = wave[: max(n - shift, 0)]
        else:
            out[: n + shift] = wave[-shift:]
        # The coin is drawn even with an empty bank, so adding noise clips does not change the shift stream.
        if float(torch.rand((), generator=gen)) < self.noise_prob and self.noise_bank:
            volume = _uniform(self.noise_volume, gen)
            out = out + volume * self._noise_segment(n, gen)
        return out.clamp_(-1.0, 1.0)


class AudioTransform:
    """The per-sample audio transform the shard reader applies: a clip of any length -> ``(clip_samples,)`` float32.

    Evaluation (``train=False``): ``fix_length(mode="center")`` — deterministic. Training: ``fix_length`` with a
    random offset, then ``augment`` (an :class:`AudioAugment`, or any callable ``(wave, generator) -> wave``) when
    given. Randomness as in :class:`AudioAugment`: a generator passed to ``__call__`` drives both steps; else the
    random crop uses the generator made from ``seed`` here and the augment its own; else torch's global RNG.
    """

    def __init__(
        self,
        train: bool,
        clip_samples: int = 16000,
        augment: AudioAugment | Callable[..., torch.Tensor] | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(train, bool):
            raise DataError(f"AudioTransform train must be a bool, got {train!r}")
        self.train = train
        self.clip_samples = _check_length(clip_samples, "AudioTransform clip_samples")
        if augment is not None and not callable(augment):
            raise DataError(f"AudioTransform augment must be an AudioAugment (or callable) or None, got {augment!r}")
        self.augment = augment
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise DataError(f"AudioTransform seed must be an int or None, got {seed!r}")
        self.generator = None if seed is None else torch.Generator().manual_seed(int(seed))

    def __repr__(self) -> str:
        return f"AudioTransform(train={self.train}, clip_samples={self.clip_samples}, augment={self.augment!r})"

    def __call__(self, wave: torch.Tensor | np.ndarray, generator: torch.Generator | None = None) -> torch.Tensor:
        if not self.train:
            return fix_length(wave, self.clip_samples, "center")
        gen = generator if generator is not None else self.generator
        wave = fix_length(wave, self.clip_samples, "random", generator=gen)
        if self.augment is not None:
            wave = self.augment(wave, generator)
        return wave


def load_noise_bank(split_dir: str | os.PathLike) -> list[torch.Tensor]:
    """Every clip of a ``background_noise`` split (written by ``data/speech_commands.py``), for
    :class:`AudioAugment`'s ``noise_bank``."""
    from .reader import ShardDataset  # the reader does not import this module; local import keeps it light

    return [wave for wave, _ in ShardDataset(split_dir)]
