"""``python pipelines/study.py --help``: the command line of :mod:`patchplace.research.study`."""

import sys

from patchplace.research.study import main

if __name__ == "__main__":
    sys.exit(main())
