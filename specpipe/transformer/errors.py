"""The one exception the model code raises for bad input: a file, a layer range, a config."""


class ModelError(ValueError):
    """A model source or request that cannot be used; the message names the file and the problem."""
