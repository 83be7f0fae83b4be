"""``python data/cifar.py --help``: the dataset recipe
:mod:`patchplace.pipelines.datasets.cifar`; its options parse without torch
(:mod:`patchplace.pipelines.datasets`), the recipe is imported to run."""

import sys

from patchplace.pipelines.datasets import main

if __name__ == "__main__":
    sys.exit(main("cifar"))
