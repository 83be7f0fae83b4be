"""``python data/image_folder.py --help``: the dataset recipe :mod:`patchplace.pipelines.datasets.image_folder`."""

import sys

from patchplace.pipelines.datasets.image_folder import main

if __name__ == "__main__":
    sys.exit(main())
