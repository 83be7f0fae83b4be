"""``python pipelines/benchmark.py --help``: the command line of :mod:`patchplace.research.benchmark`."""

import sys

from patchplace.research.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
