"""``python pipelines/demo.py --help``: the command line of :mod:`patchplace.pipelines.demo` (also
``accelerate launch pipelines/demo.py ...`` and the console script ``patchplace-demo``)."""

import sys

from patchplace.pipelines.demo import main

if __name__ == "__main__":
    sys.exit(main())
