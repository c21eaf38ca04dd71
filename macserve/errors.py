"""The one error type commands turn into a one-line message and exit code 2."""


class MacserveError(Exception):
    """A problem with the user's input or environment, printed as one line."""
