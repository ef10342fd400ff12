"""The one exception type the CLI turns into a one-line message."""


class QCGError(Exception):
    """A problem with the user's input or setup, explained in one line."""
