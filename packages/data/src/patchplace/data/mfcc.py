"""The speech frontend of MP3: 40 MFCCs from 30 ms windows with a 10 ms hop, as an exportable torch module.

MP3 (Zhai et al., "Position Prediction as an Effective Pretraining Strategy", arXiv 2207.07611, §3.1 and §4.3) feeds
its speech Transformer "40 mel filterbank cepstral coefficients (MFCCs), computed from 30ms of raw waveforms,
strided by 10ms between frames, following (Choi et al., 2019)", Table 1 counts 100 positions for a 1 s clip, and
§4.1 keeps TC-ResNet's "audio preprocessing routines ... intact". Each frame is one 1-D patch.

Three named front ends (:data:`FRONTENDS`, :func:`build_frontend`):

- ``"mp3_speech"``: TC-ResNet's *training* path (``datasets/preprocessors.py`` ``MFCCPreprocessor._preprocess``,
  with its script's ``--preprocess_method mfcc --num_mfccs 40 --window_size_ms 30 --window_stride_ms 10`` and
  ``audio_data_wrapper.py``'s defaults ``num_mel_bins=64``, ``lower_edge_hertz=80``, ``upper_edge_hertz=7600``):
  ``tf.signal.stft(frame_length=480, frame_step=160)`` (fft 512, periodic hann) -> power -> 64 HTK mel bands
  80-7600 Hz -> ``log(x + 1e-6)`` -> ``mfccs_from_log_mel_spectrograms`` -> first 40, with the end of the clip
  zero-padded as ``stft(pad_end=True)`` so that 1 s gives Table 1's 100 frames (TC-ResNet's unpadded stft gives 98).
- ``"tc_resnet"``: the same without the end padding: 98 frames, TC-ResNet exactly.
- ``"tf_speech_commands"`` (``MFCC()``'s defaults): TensorFlow's ``speech_commands`` example's ``mfcc`` op
  defaults (40 bands, 20-4000 Hz), on librosa's centred frames: 101 frames, dB with an 80 dB floor.

The one difference from TensorFlow left in ``"mp3_speech"`` / ``"tc_resnet"``: librosa's mel triangles are linear
in Hz between HTK-mel-spaced edges, TensorFlow's ``linear_to_mel_weight_matrix`` linear in mel; at these settings
the weights differ by at most 0.0046 and the MFCCs by 0.1% (relative L2; docs/data.md).

The numbers are librosa's (``librosa.feature.mfcc`` with the arguments listed in :class:`MFCC`), so features can be
checked against a reference implementation; the computation is plain torch ops (a strided conv1d with a precomputed
windowed-DFT basis, matmuls, log10, max) so the frontend can live inside an exported ONNX graph (docs/design.md:
speech models take ``waveform (B, samples)``).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .errors import DataError
from .extras import missing

FRAMINGS = ("center", "valid", "tf", "tf_pad_end")
LOGS = ("db", "ln")
DCT_NORMS = ("ortho", "tf")

# MFCC keyword arguments of each named front end (see the module docstring for their sources).
FRONTENDS: dict[str, dict[str, object]] = {
    "tf_speech_commands": {},
    "mp3_speech": dict(n_mels=64, fmin=80.0, fmax=7600.0, framing="tf_pad_end", htk=True, mel_norm=None,
                       log="ln", log_offset=1e-6, top_db=None, dct_norm="tf"),
    "tc_resnet": dict(n_mels=64, fmin=80.0, fmax=7600.0, framing="tf", htk=True, mel_norm=None, log="ln",
                      log_offset=1e-6, top_db=None, dct_norm="tf"),
}


def _positive_int(name: str, value: object) -> int:
    # bool is an int subclass; MFCC(n_mfcc=True) is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise DataError(f"MFCC {name} must be a positive int, got {value!r}")
    return int(value)


class MFCC(nn.Module):
    """Waveform ``(B, samples)`` -> MFCCs ``(B, T, n_mfcc)``, ``T`` = :meth:`num_frames` (``framing``).

    The speech frontend of MP3 (§3.1, §4.3), which follows TC-ResNet (Choi et al., 2019): 40 MFCCs from 30 ms
    windows (480 samples at 16 kHz) every 10 ms (160 samples). The defaults are the ``"tf_speech_commands"`` front
    end (101 frames for 1 s); ``MFCC.preset("mp3_speech")`` is the paper's (100 frames; module docstring).

    The defaults are equivalent to (per clip, in float64 up to float32 rounding; tested in ``tests/test_mfcc.py``)::

        librosa.feature.mfcc(y=y, sr=16000, n_mfcc=40, n_fft=512, hop_length=160, win_length=480,
                             window="hann", center=True, pad_mode="constant", n_mels=40, fmin=20, fmax=4000,
                             htk=False, mel_norm="slaney", norm="ortho", dct_type=2).T

    i.e. hann-windowed power spectrum -> slaney mel filterbank -> ``power_to_db`` (ref 1.0, amin 1e-10, top_db 80,
    clipped against the maximum over the clip's own time x mel) -> orthonormal DCT-II, first ``n_mfcc``.

    ``MFCC.preset("mp3_speech")``: frames of exactly ``win_length`` samples starting every ``hop_length``, the end
    zero-padded to ``ceil(samples / hop_length)`` frames (``framing="tf_pad_end"``), HTK mel bands without area
    normalization (``htk=True, mel_norm=None``), ``ln(mel power + 1e-6)`` (``log="ln"``) and TensorFlow's DCT
    scaling (``dct_norm="tf"``: the unnormalized DCT-II over ``sqrt(2 n_mels)``), i.e. per clip::

        S = librosa.feature.melspectrogram(y=np.pad(y, (16, 16 + 320)), sr=16000, n_fft=512, hop_length=160,
                                           win_length=480, window="hann", center=False, power=2.0, n_mels=64,
                                           fmin=80, fmax=7600, htk=True, norm=None)
        librosa.feature.mfcc(S=np.log(S + 1e-6), n_mfcc=40, dct_type=2, norm=None).T / np.sqrt(2 * 64)

    Usage::

        frontend = MFCC()
        wave = torch.randn(8, 16000) * 0.1       # (B, samples) float32 in [-1, 1]
        feats = frontend(wave)                   # (8, 101, 40)
        assert feats.shape[1] == frontend.num_frames(16000)
        assert MFCC.preset("mp3_speech")(wave).shape == (8, 100, 40)

    Args:
        sample_rate: Hz of the input waveform.
        n_mfcc: cepstral coefficients kept (the paper's 40).
        n_mels: mel bands (TC-ResNet uses 40 bands and keeps all 40 coefficients).
        win_length: analysis window in samples (30 ms at 16 kHz).
        hop_length: frame stride in samples (10 ms at 16 kHz).
        n_fft: DFT size; the window is zero-padded (centered) to it.
        fmin, fmax: mel filterbank edges in Hz; ``fmax=None`` means ``sample_rate / 2``.
        framing: where frame t lies. ``"center"`` (librosa ``center=True``): ``n_fft // 2`` zeros on both sides,
            frame t centred on sample ``t * hop_length``, ``1 + samples // hop`` frames; ``"valid"`` (librosa
            ``center=False``): ``n_fft``-long frames from sample ``t * hop_length``, ``1 + (samples - n_fft) // hop``;
            ``"tf"`` (``tf.signal.stft``): ``win_length`` samples from ``t * hop_length``,
            ``1 + (samples - win_length) // hop``; ``"tf_pad_end"`` (``tf.signal.stft(pad_end=True)``): the same
            with the end zero-padded, ``ceil(samples / hop)`` frames.
        htk: HTK's mel formula (TensorFlow's) rather than Slaney's.
        mel_norm: ``"slaney"`` (each band of unit area) or ``None`` (peak 1, TensorFlow's).
        log: ``"db"``: librosa ``power_to_db`` (ref 1, amin 1e-10, ``top_db``); ``"ln"``: ``ln(power + log_offset)``
            (TensorFlow / TC-ResNet).
        log_offset: the offset of ``log="ln"``.
        top_db: (``log="db"``) dynamic range kept below each clip's loudest mel bin, in dB; ``None`` disables the
            clipping (and must be None with ``log="ln"``).
        dct_norm: ``"ortho"`` (orthonormal DCT-II) or ``"tf"`` (TensorFlow's ``mfccs_from_log_mel_spectrograms``:
            the unnormalized DCT-II times ``1 / sqrt(2 n_mels)``, i.e. orthonormal except coefficient 0, which is
            ``sqrt(2)`` larger).
    """

    def __init__(
        self,
        sample_rate: int = 16000,
        n_mfcc: int = 40,
        n_mels: int = 40,
        win_length: int = 480,
        hop_length: int = 160,
        # TensorFlow's audio_spectrogram (used by TC-ResNet) rounds the 480-sample window up to the next power of
        # two for its FFT; librosa then centers the window inside that frame with zeros (pad_center).
        n_fft: int = 512,
        # 20 Hz - 4 kHz are the defaults of TensorFlow's mfcc op (lower_frequency_limit / upper_frequency_limit),
        # which TC-ResNet's speech_commands pipeline used unchanged.
        fmin: float = 20.0,
        fmax: float | None = 4000.0,
        framing: str = "center",
        htk: bool = False,
        mel_norm: str | None = "slaney",
        log: str = "db",
        log_offset: float = 1e-6,
        # librosa.power_to_db's default; it is what librosa.feature.mfcc applies (it takes no top_db argument).
        top_db: float | None = 80.0,
        dct_norm: str = "ortho",
    ) -> None:
        super().__init__()
        self._set_sizes(sample_rate, n_mfcc, n_mels, win_length, hop_length, n_fft, fmin, fmax)
        self._check_choices(framing, htk, mel_norm, log, log_offset, top_db, dct_norm)
        self.framing, self.htk, self.mel_norm = framing, htk, mel_norm
        self.log, self.log_offset, self.dct_norm = log, float(log_offset), dct_norm
        self.top_db = None if top_db is None else float(top_db)
        mel = self._mel_bands()
        basis, mel_t = self._dft_basis(mel)
        # Non-persistent: they are derived from the constructor args, so checkpoints need not (and should not)
        # carry them; float32 because that is what the exported graph computes in.
        self.register_buffer("dft_basis", torch.from_numpy(basis).float().unsqueeze(1), persistent=False)
        self.register_buffer("mel_matrix", torch.from_numpy(mel_t).float(), persistent=False)
        self.register_buffer("dct_matrix", torch.from_numpy(self._dct()).float(), persistent=False)

    def _set_sizes(self, sample_rate: object, n_mfcc: object, n_mels: object, win_length: object,
                   hop_length: object, n_fft: object, fmin: float, fmax: float | None) -> None:
        """The sizes and the mel filterbank's edges, each refused in one line where no MFCC could come of it."""
        self.sample_rate = _positive_int("sample_rate", sample_rate)
        self.n_mfcc = _positive_int("n_mfcc", n_mfcc)
        self.n_mels = _positive_int("n_mels", n_mels)
        self.win_length = _positive_int("win_length", win_length)
        self.hop_length = _positive_int("hop_length", hop_length)
        self.n_fft = _positive_int("n_fft", n_fft)
        if self.win_length > self.n_fft:
            raise DataError(f"MFCC win_length={win_length} exceeds n_fft={n_fft}; raise n_fft or shorten the window")
        if self.n_mfcc > self.n_mels:
            raise DataError(f"MFCC n_mfcc={n_mfcc} exceeds n_mels={n_mels}; keep at most n_mels coefficients")
        nyquist = self.sample_rate / 2
        fmax = nyquist if fmax is None else float(fmax)
        fmin = float(fmin)
        if not 0.0 <= fmin < fmax:
            raise DataError(f"MFCC needs 0 <= fmin < fmax, got fmin={fmin}, fmax={fmax}")
        if fmax > nyquist:
            raise DataError(f"MFCC fmax={fmax} Hz is above the Nyquist frequency {nyquist} Hz of sample_rate="
                            f"{self.sample_rate}; lower fmax")
        self.fmin, self.fmax = fmin, fmax

    def _mel_bands(self) -> np.ndarray:
        """librosa's mel filterbank ``(n_mels, n_fft // 2 + 1)`` in float64; a band left empty is refused."""
        try:  # the [audio] extra: librosa's mel matrix, scipy's window and DCT; not at the top, so that importing
            # this module (the export does) needs neither
            import librosa
            import scipy.fft  # _dct's
            import scipy.signal  # noqa: F401  (_dft_basis's)
        except ImportError as exc:
            raise missing(exc, "the MFCC frontend") from exc

        with warnings.catch_warnings():
            # librosa only warns about empty bands; they are turned into a DataError just below.
            warnings.filterwarnings("ignore", message="Empty filters detected")
            mel = librosa.filters.mel(sr=self.sample_rate, n_fft=self.n_fft, n_mels=self.n_mels, fmin=self.fmin,
                                      fmax=self.fmax, htk=self.htk, norm=self.mel_norm).astype(np.float64)
        if not mel.any(axis=1).all():
            # An all-zero band would be a constant -100 dB feature, i.e. a silent bug.
            raise DataError(f"MFCC n_mels={self.n_mels} is too many for n_fft={self.n_fft} between {self.fmin} and "
                            f"{self.fmax} Hz (some mel bands are empty); lower n_mels or raise n_fft")
        return mel

    def _dft_basis(self, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The windowed real DFT as conv taps ``(2 n_bins, win_length)`` (cos rows, then sin rows) and the mel
        projection of their squares ``(2 n_bins, n_mels)``, over the bins some mel band touches."""
        import librosa
        import scipy.signal

        # Bins no mel band touches (everything above fmax and the DC bin) contribute exactly zero, so their DFT
        # rows are dropped: 127 of 257 bins remain at the defaults (fmax 4 kHz), halving the conv.
        bins = np.flatnonzero(mel.any(axis=0))

        # librosa's window: scipy's periodic hann of win_length, zero-padded centered to n_fft. Only its
        # win_length-long support is used as conv taps; _frame_signal shifts the input by the left padding.
        window = librosa.util.pad_center(scipy.signal.get_window("hann", self.win_length, fftbins=True),
                                         size=self.n_fft)
        self._lpad = (self.n_fft - self.win_length) // 2
        self._rpad = self.n_fft - self.win_length - self._lpad
        taps = np.arange(self._lpad, self._lpad + self.win_length)
        # Real DFT as one matmul: X_k = sum_n w[n] x[n] (cos(2 pi k n / N) - i sin(2 pi k n / N)); the sign of the
        # imaginary part is irrelevant for the power. Built in float64 and rounded once.
        angle = 2.0 * np.pi * np.outer(bins, taps) / self.n_fft  # (n_bins, win_length)
        basis = np.concatenate([np.cos(angle), np.sin(angle)], axis=0) * window[taps]  # (2 n_bins, win_length)
        # |X_k|^2 = re^2 + im^2, so the mel projection of the power spectrum is the mel matrix applied to the
        # squared conv outputs, with the mel columns repeated for the cos and the sin rows.
        mel_t = np.concatenate([mel[:, bins], mel[:, bins]], axis=1).T  # (2 n_bins, n_mels)
        return basis, mel_t

    def _dct(self) -> np.ndarray:
        """The first ``n_mfcc`` DCT-II rows as a ``(n_mels, n_mfcc)`` matrix for ``features @``."""
        import scipy.fft

        # DCT-II along the mel axis: with axis=0, column j of the result is dct(e_j), so this is the DCT matrix C
        # (dct(v) = C @ v); features (.., n_mels) @ C[:n_mfcc].T gives the first n_mfcc coefficients. TensorFlow
        # scales the unnormalized DCT by 1 / sqrt(2 n_mels) (mfccs_from_log_mel_spectrograms).
        if self.dct_norm == "ortho":
            dct = scipy.fft.dct(np.eye(self.n_mels), type=2, norm="ortho", axis=0)
        else:
            dct = scipy.fft.dct(np.eye(self.n_mels), type=2, norm=None, axis=0) / np.sqrt(2.0 * self.n_mels)
        return dct[: self.n_mfcc].T  # (n_mels, n_mfcc)

    @classmethod
    def preset(cls, name: str, **overrides: object) -> MFCC:
        """The named front end of :data:`FRONTENDS` (``"mp3_speech"``: the paper's), with ``overrides``."""
        if name not in FRONTENDS:
            raise DataError(f"MFCC preset {name!r} is not one of {sorted(FRONTENDS)}")
        return cls(**{**FRONTENDS[name], **overrides})

    @staticmethod
    def _check_choices(framing: object, htk: object, mel_norm: object, log: object, log_offset: object,
                       top_db: object, dct_norm: object) -> None:
        if framing not in FRAMINGS:
            raise DataError(f"MFCC framing must be one of {FRAMINGS}, got {framing!r}")
        if not isinstance(htk, bool):
            raise DataError(f"MFCC htk must be a bool, got {htk!r}")
        if mel_norm not in ("slaney", None):
            raise DataError(f"MFCC mel_norm must be 'slaney' or None, got {mel_norm!r}")
        if log not in LOGS:
            raise DataError(f"MFCC log must be one of {LOGS}, got {log!r}")
        if isinstance(log_offset, bool) or not isinstance(log_offset, (int, float)) or not log_offset > 0:
            raise DataError(f"MFCC log_offset must be a float > 0, got {log_offset!r}")
        if top_db is not None and (log != "db" or not float(top_db) >= 0.0):
            raise DataError(f"MFCC top_db must be >= 0 or None with log='db', and None with log='ln'; got "
                            f"top_db={top_db!r}, log={log!r}")
        if dct_norm not in DCT_NORMS:
            raise DataError(f"MFCC dct_norm must be one of {DCT_NORMS}, got {dct_norm!r}")

    def _min_samples(self) -> int:
        return {"center": 0, "valid": self.n_fft, "tf": self.win_length, "tf_pad_end": 1}[self.framing]

    def num_frames(self, samples: int) -> int:
        """Frames produced for a clip of ``samples`` samples (1 s: 101 at the defaults, 100 for "mp3_speech")."""
        samples = int(samples)
        if samples < self._min_samples():
            raise DataError(f"MFCC with framing={self.framing!r} needs at least {self._min_samples()} samples, "
                            f"got {samples}")
        if self.framing == "center":
            return 1 + samples // self.hop_length
        if self.framing == "valid":
            return 1 + (samples - self.n_fft) // self.hop_length
        if self.framing == "tf":
            return 1 + (samples - self.win_length) // self.hop_length
        return -(-samples // self.hop_length)

    def extra_repr(self) -> str:
        return (f"sample_rate={self.sample_rate}, n_mfcc={self.n_mfcc}, n_mels={self.n_mels}, "
                f"win_length={self.win_length}, hop_length={self.hop_length}, n_fft={self.n_fft}, "
                f"fmin={self.fmin}, fmax={self.fmax}, framing={self.framing}, htk={self.htk}, "
                f"mel_norm={self.mel_norm}, log={self.log}, log_offset={self.log_offset}, top_db={self.top_db}, "
                f"dct_norm={self.dct_norm}")

    def _check_input(self, wave: torch.Tensor) -> None:
        # Shape and dtype checks only: they are static under tracing / export, unlike checks on values.
        if not isinstance(wave, torch.Tensor):
            raise DataError(f"MFCC expects a torch.Tensor waveform (B, samples), got {type(wave).__name__}; "
                            "wrap it with torch.as_tensor")
        if wave.dim() == 1:
            raise DataError(f"MFCC expects a batch (B, samples), got one clip of shape {tuple(wave.shape)}; "
                            "use wave.unsqueeze(0)")
        if wave.dim() != 2:
            raise DataError(f"MFCC expects a waveform batch (B, samples), got shape {tuple(wave.shape)}; "
                            "downmix channels and flatten extra dimensions first")
        if not wave.is_floating_point():
            raise DataError(f"MFCC expects a float waveform in [-1, 1], got {wave.dtype}; "
                            "convert PCM with wave.float() / 32768")
        if wave.shape[1] < self._min_samples():
            raise DataError(f"MFCC with framing={self.framing!r} needs at least {self._min_samples()} samples, "
                            f"got {wave.shape[1]}; pad the clip or use framing='center'")

    def _frame_signal(self, wave: torch.Tensor) -> torch.Tensor:
        """Windowed DFT of every frame: ``(B, samples) -> (B, T, 2 n_bins)`` (cos rows, then sin rows)."""
        # Only the win_length non-zero taps are convolved: a frame's DFT taps start _lpad samples into librosa's
        # n_fft-long frame. Where the window sits inside the n_fft frame (librosa: centred, TensorFlow: at the
        # start) changes the DFT's phase only, not the power.
        if self.framing == "center":
            # Zero padding by n_fft // 2 (librosa pad_mode="constant"), minus the window's own zero margin.
            half = self.n_fft // 2
            wave = F.pad(wave, (half - self._lpad, self.n_fft - half - self._rpad))
        elif self.framing == "valid":
            wave = wave[:, self._lpad : wave.shape[1] - self._rpad]
        elif self.framing == "tf_pad_end":
            # tf.signal.frame(pad_end=True): zeros after the clip up to the last frame's end.
            samples = wave.shape[1]
            wave = F.pad(wave, (0, (self.num_frames(samples) - 1) * self.hop_length + self.win_length - samples))
        # conv1d with stride hop_length frames and DFTs in one op, with no data-dependent control flow.
        spec = F.conv1d(wave.unsqueeze(1), self.dft_basis, stride=self.hop_length)  # (B, 2 n_bins, T)
        return spec.transpose(1, 2)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        """``wave (B, samples)`` float in [-1, 1] -> MFCCs ``(B, T, n_mfcc)`` float32."""
        self._check_input(wave)
        spec = self._frame_signal(wave.to(self.dft_basis.dtype))
        mel_power = (spec * spec) @ self.mel_matrix  # (B, T, n_mels)
        if self.log == "ln":  # TC-ResNet: tf.log(mel_spectrograms + 1e-6)
            return torch.log(mel_power + self.log_offset) @ self.dct_matrix
        # librosa.power_to_db with ref=1.0, amin=1e-10.
        log_mel = 10.0 * torch.log10(torch.clamp(mel_power, min=1e-10))
        if self.top_db is not None:
            # librosa clips against the max of the whole array it is given; it is called once per clip, so the
            # reference is each sample's own max over time x mel (never the batch's).
            peak = log_mel.amax(dim=(1, 2), keepdim=True)
            log_mel = torch.maximum(log_mel, peak - self.top_db)
        return log_mel @ self.dct_matrix


def build_frontend(spec: str | dict[str, object] | None = None) -> MFCC:
    """The speech front end a config names: None -> ``MFCC()`` (``"tf_speech_commands"``); a name of
    :data:`FRONTENDS` (``"mp3_speech"``: MP3 §3.1 / Table 1's); or a dict of :class:`MFCC` arguments, optionally with
    ``preset`` (its arguments, overridden by the others)."""
    if spec is None:
        return MFCC()
    if isinstance(spec, str):
        return MFCC.preset(spec)
    if not isinstance(spec, dict):
        raise DataError(f"a speech front end is a preset name {sorted(FRONTENDS)} or a dict of MFCC arguments, got "
                        f"{spec!r}")
    args = dict(spec)
    name = args.pop("preset", "tf_speech_commands")
    try:
        return MFCC.preset(str(name), **args)
    except TypeError as exc:  # an argument MFCC does not have
        raise DataError(f"speech front end {spec!r}: {exc}") from None
