"""``python data/fashion_mnist.py --help``: the dataset recipe
:mod:`patchplace.pipelines.datasets.fashion_mnist`; its options parse without torch
(:mod:`patchplace.pipelines.datasets`), the recipe is imported to run."""

import sys

from patchplace.pipelines.datasets import main

if __name__ == "__main__":
    sys.exit(main("fashion_mnist"))
