"""Optional stacks imported where they are used, so an image-only install never needs them.

patchplace-data's ``[audio]`` extra (librosa, scipy, soundfile) serves the WAV codecs and the MFCC frontend; without
it, using either raises :class:`MissingExtra`, one line naming the ``pip install`` that brings it. The imports stay
plain ``import`` statements inside the functions (``tests/test_layout.py`` reads them to check the declarations)::

    try:
        import soundfile
    except ImportError as exc:
        raise missing(exc, "reading WAV audio") from exc
"""

from __future__ import annotations

from .errors import DataError


class MissingExtra(DataError, ImportError):
    """A feature needs a package of an extra that is not installed (one line: the package and the pip command).
    A :class:`DataError` (the entry points print it and exit 2) and an :class:`ImportError`."""


def extra_message(feature: str, module: str, dist: str, extra: str, path: str) -> str:
    """The one-line message of a missing ``module``: the extra ``dist[extra]`` (in a checkout: ``./path``) brings it."""
    return (f"{feature} needs {module}, which is not installed; it comes with the [{extra}] extra: "
            f"pip install '{dist}[{extra}]' (from a checkout: pip install './{path}[{extra}]')")


def missing(exc: ImportError, feature: str, extra: str = "audio") -> MissingExtra:
    """The :class:`MissingExtra` for ``exc`` (a failed import of ``feature``): patchplace-data's ``extra``."""
    module = exc.name or str(exc)
    return MissingExtra(extra_message(feature, module, "patchplace-data", extra, "packages/data"))
