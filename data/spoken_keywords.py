"""``python data/spoken_keywords.py --help``: the dataset recipe
:mod:`patchplace.pipelines.datasets.spoken_keywords`."""

import sys

from patchplace.pipelines.datasets.spoken_keywords import main

if __name__ == "__main__":
    sys.exit(main())
