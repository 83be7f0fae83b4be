"""``python data/speech_commands.py --help``: the dataset recipe
:mod:`patchplace.pipelines.datasets.speech_commands`."""

import sys

from patchplace.pipelines.datasets.speech_commands import main

if __name__ == "__main__":
    sys.exit(main())
