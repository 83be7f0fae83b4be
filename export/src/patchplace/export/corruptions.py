"""ImageNet-C's ``glass_blur`` and ``fog`` as ``imagecorruptions`` 1.1.2 computes them, on NumPy 2 and new skimage.

``imagecorruptions`` (Apache-2.0; Hendrycks & Dietterich, "Benchmarking Neural Network Robustness to Common
Corruptions and Perturbations", ICLR 2019) fails on two of its 15 corruptions under NumPy 2 / scikit-image >= 0.19:
``glass_blur`` calls ``skimage.filters.gaussian(..., multichannel=True)`` (removed: now ``channel_axis=-1``) and
``fog``'s ``plasma_fractal`` allocates with ``np.float_`` (removed in NumPy 2: ``np.float64``). The functions below
are its code with exactly those two spellings changed — same math, same order of draws from NumPy's global RNG — so
for one ``np.random.seed`` they give its images (``export/tests/test_ort_at_scale.py`` holds them against the
library's own functions with the old API shimmed back in). :func:`corrupt` is ``imagecorruptions.corrupt`` with
these two in place of its broken ones; the other 13 are the library's.

imagecorruptions and scikit-image are patchplace-export's ``[corruptions]`` extra (an image-only export goes
without them): imported on use, their absence is one :class:`~.exporter.Unavailable` line naming the extra."""

from __future__ import annotations

import warnings

import numpy as np
from PIL import Image

from patchplace.data.extras import extra_message

from .errors import Unavailable

MENDED = ("glass_blur", "fog")


def require_library() -> None:
    """imagecorruptions and scikit-image importable (the ``[corruptions]`` extra), else :class:`~.exporter.
    Unavailable`, one line with the pip command: the evaluator skips the robustness part with it (instead of listing
    every corruption as failed) and keeps the rest."""
    try:
        with warnings.catch_warnings():  # imagecorruptions imports pkg_resources, which warns on import
            warnings.simplefilter("ignore")
            import imagecorruptions  # noqa: F401
            import skimage.filters  # noqa: F401
    except ImportError as exc:
        feature = "the robustness evaluation (ImageNet-C corruptions)"
        raise Unavailable(extra_message(feature, exc.name or str(exc), "patchplace-export", "corruptions", "export")
                          + "; or leave it out with --robustness-limit 0") from exc


def glass_blur(x, severity: int = 1) -> np.ndarray:
    """``imagecorruptions.corruptions.glass_blur`` with ``channel_axis=-1`` for ``multichannel=True``."""
    from skimage.filters import gaussian  # the [corruptions] extra

    c = [(0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)][severity - 1]
    x = np.uint8(gaussian(np.array(x) / 255., sigma=c[0], channel_axis=-1) * 255)
    x_shape = np.array(x).shape
    for _ in range(c[2]):  # locally shuffle pixels
        for h in range(x_shape[0] - c[1], c[1], -1):
            for w in range(x_shape[1] - c[1], c[1], -1):
                dx, dy = np.random.randint(-c[1], c[1], size=(2,))
                h_prime, w_prime = h + dy, w + dx
                x[h, w], x[h_prime, w_prime] = x[h_prime, w_prime], x[h, w]  # swap
    return np.clip(gaussian(x / 255., sigma=c[0], channel_axis=-1), 0, 1) * 255


def plasma_fractal(mapsize: int = 256, wibbledecay: float = 3) -> np.ndarray:
    """``imagecorruptions.corruptions.plasma_fractal`` (diamond-square heightmap in [0, 1]) with ``np.float64``."""
    assert mapsize & (mapsize - 1) == 0
    maparray = np.empty((mapsize, mapsize), dtype=np.float64)
    maparray[0, 0] = 0
    stepsize = mapsize
    wibble = 100

    def wibbledmean(array):
        return array / 4 + wibble * np.random.uniform(-wibble, wibble, array.shape)

    def fillsquares():
        cornerref = maparray[0:mapsize:stepsize, 0:mapsize:stepsize]
        squareaccum = cornerref + np.roll(cornerref, shift=-1, axis=0)
        squareaccum += np.roll(squareaccum, shift=-1, axis=1)
        maparray[stepsize // 2:mapsize:stepsize, stepsize // 2:mapsize:stepsize] = wibbledmean(squareaccum)

    def filldiamonds():
        size = maparray.shape[0]
        drgrid = maparray[stepsize // 2:size:stepsize, stepsize // 2:size:stepsize]
        ulgrid = maparray[0:size:stepsize, 0:size:stepsize]
        ldrsum = drgrid + np.roll(drgrid, 1, axis=0)
        lulsum = ulgrid + np.roll(ulgrid, -1, axis=1)
        maparray[0:size:stepsize, stepsize // 2:size:stepsize] = wibbledmean(ldrsum + lulsum)
        tdrsum = drgrid + np.roll(drgrid, 1, axis=1)
        tulsum = ulgrid + np.roll(ulgrid, -1, axis=0)
        maparray[stepsize // 2:size:stepsize, 0:size:stepsize] = wibbledmean(tdrsum + tulsum)

    while stepsize >= 2:
        fillsquares()
        filldiamonds()
        stepsize //= 2
        wibble /= wibbledecay
    maparray -= maparray.min()
    return maparray / maparray.max()


def _next_power_of_2(x: int) -> int:
    return 1 if x == 0 else 2 ** (x - 1).bit_length()


def fog(x, severity: int = 1) -> np.ndarray:
    """``imagecorruptions.corruptions.fog`` on :func:`plasma_fractal` (``np.float64``)."""
    c = [(1.5, 2), (2., 2), (2.5, 1.7), (2.5, 1.5), (3., 1.4)][severity - 1]
    shape = np.array(x).shape
    map_size = _next_power_of_2(int(np.max(shape)))
    x = np.array(x) / 255.
    max_val = x.max()
    x_shape = np.array(x).shape
    if len(x_shape) < 3 or x_shape[2] < 3:
        x += c[0] * plasma_fractal(mapsize=map_size, wibbledecay=c[1])[:shape[0], :shape[1]]
    else:
        x += c[0] * plasma_fractal(mapsize=map_size, wibbledecay=c[1])[:shape[0], :shape[1]][..., np.newaxis]
    return np.clip(x * max_val / (max_val + c[0]), 0, 1) * 255


def corrupt(image: np.ndarray, corruption_name: str, severity: int) -> np.ndarray:
    """``imagecorruptions.corrupt(image, severity, corruption_name)`` (uint8 (H, W, 3) -> uint8) with the mended
    ``glass_blur`` / ``fog``; the input checks are the library's (it runs them for the other 13)."""
    require_library()
    if corruption_name not in MENDED:
        with warnings.catch_warnings():  # it imports pkg_resources (hence setuptools<81), which warns on import
            warnings.simplefilter("ignore")
            from imagecorruptions import corrupt as reference

            return reference(image, corruption_name=corruption_name, severity=severity)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 32:
        raise ValueError(f"expected a uint8 (H >= 32, W >= 32, 3) image, got {image.dtype} {image.shape}")
    if severity not in (1, 2, 3, 4, 5):
        raise ValueError(f"severity must be an integer in [1, 5], got {severity}")
    function = glass_blur if corruption_name == "glass_blur" else fog
    return np.uint8(function(Image.fromarray(image), severity))
