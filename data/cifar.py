"""``python data/cifar.py --help``: the dataset recipe :mod:`patchplace.pipelines.datasets.cifar`."""

import sys

from patchplace.pipelines.datasets.cifar import main

if __name__ == "__main__":
    sys.exit(main())
