"""``python pipelines/pretrain.py --help``: the command line of :mod:`patchplace.pipelines.pretrain` (also
``accelerate launch pipelines/pretrain.py ...`` and the console script ``patchplace-pretrain``)."""

import sys

from patchplace.pipelines.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
