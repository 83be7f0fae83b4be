"""``python data/image_folder.py --help``: the dataset recipe
:mod:`patchplace.pipelines.datasets.image_folder`; its options parse without torch
(:mod:`patchplace.pipelines.datasets`), the recipe is imported to run."""

import sys

from patchplace.pipelines.datasets import main

if __name__ == "__main__":
    sys.exit(main("image_folder"))
