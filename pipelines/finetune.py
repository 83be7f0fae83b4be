"""``python pipelines/finetune.py --help``: the command line of :mod:`patchplace.pipelines.finetune` (also
``accelerate launch pipelines/finetune.py ...`` and the console script ``patchplace-finetune``)."""

import sys

from patchplace.pipelines.cli import main  # --help without importing torch

if __name__ == "__main__":
    sys.exit(main("finetune"))
