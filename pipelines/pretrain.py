"""``python pipelines/pretrain.py --help``: the command line of :mod:`patchplace.pipelines.pretrain` (also
``accelerate launch pipelines/pretrain.py ...`` and the console script ``patchplace-pretrain``)."""

import sys

from patchplace.pipelines.cli import main  # --help without importing torch

if __name__ == "__main__":
    sys.exit(main("pretrain"))
