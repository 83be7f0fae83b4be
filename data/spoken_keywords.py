"""``python data/spoken_keywords.py --help``: the dataset recipe
:mod:`patchplace.pipelines.datasets.spoken_keywords`; its options parse without torch
(:mod:`patchplace.pipelines.datasets`), the recipe is imported to run."""

import sys

from patchplace.pipelines.datasets import main

if __name__ == "__main__":
    sys.exit(main("spoken_keywords"))
