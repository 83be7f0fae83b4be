"""``python data/fashion_mnist.py --help``: the dataset recipe :mod:`patchplace.pipelines.datasets.fashion_mnist`."""

import sys

from patchplace.pipelines.datasets.fashion_mnist import main

if __name__ == "__main__":
    sys.exit(main())
