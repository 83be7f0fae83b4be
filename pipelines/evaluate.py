"""``python pipelines/evaluate.py --help``: the command line of :mod:`patchplace.pipelines.evaluate` (also
``accelerate launch pipelines/evaluate.py ...`` and the console script ``patchplace-evaluate``)."""

import sys

from patchplace.pipelines.cli import main  # --help without importing torch

if __name__ == "__main__":
    sys.exit(main("evaluate"))
