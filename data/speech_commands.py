"""``python data/speech_commands.py --help``: the dataset recipe
:mod:`patchplace.pipelines.datasets.speech_commands`; its options parse without torch
(:mod:`patchplace.pipelines.datasets`), the recipe is imported to run."""

import sys

from patchplace.pipelines.datasets import main

if __name__ == "__main__":
    sys.exit(main("speech_commands"))
