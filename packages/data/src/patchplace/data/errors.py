"""One exception type for every data problem a user can act on.

Messages are one line: what is wrong (naming the file, shard, field or key) and how to fix it.
"""


class DataError(ValueError):
    """A dataset, shard, manifest or sample is missing, corrupt or does not match what was expected."""
