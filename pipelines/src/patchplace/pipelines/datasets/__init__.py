"""Dataset recipes: each module turns a real on-disk dataset into WebDataset shards + manifest.json.

Run them as scripts (``python data/fashion_mnist.py --help``: their options parse in :mod:`.cli`, without
torch, the recipe is imported to run); tests import them as ``data.<recipe>``.
"""
