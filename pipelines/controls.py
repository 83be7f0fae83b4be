"""``python pipelines/controls.py --help``: the command line of :mod:`patchplace.research.controls`."""

import sys

from patchplace.research.controls import main

if __name__ == "__main__":
    sys.exit(main())
