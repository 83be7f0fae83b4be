"""``python pipelines/study.py --help``: the command line of :mod:`patchplace.research.study`."""

import sys

from patchplace.research.cli import main  # --help and usage errors without importing torch

if __name__ == "__main__":
    sys.exit(main("study"))
