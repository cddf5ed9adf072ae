"""User-facing errors.

A ``SensaiError`` carries a message meant for the person at the terminal or the HTTP client: the
CLI prints it as one line and exits non-zero, the gateway turns it into a 4xx JSON body. Anything
else that escapes is a bug.
"""


class SensaiError(Exception):
    """A problem with the user's input, data or files, explained in one line."""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, for a one-line error quoting it; its type's name when
    the message is empty (many library errors have none)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class DataError(SensaiError):
    """A dataset is missing, malformed or does not match what a model expects."""


class CheckpointError(SensaiError):
    """Weights or a record on disk are missing, corrupt or do not fit the model."""


class UnknownModelError(SensaiError):
    """A model name that the registry does not know."""


class ExportError(SensaiError):
    """An ONNX file could not be written or does not compute what the torch model computes."""
