"""The error type for model configuration and input mistakes (one-line messages naming the fix)."""


class ModelError(ValueError):
    """A model config, checkpoint or input does not match what the backbone expects."""
