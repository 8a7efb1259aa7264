"""The one error type of training: bad input, named with its fix, raised before anything is written."""


class TrainingError(ValueError):
    """A training input (data folder, settings, pipeline) vidmem cannot use; the message says the fix."""
