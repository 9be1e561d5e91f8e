"""The project's own error for bad input.

Whatever dflash-mlx refuses on purpose (a setting out of range, a drafter made for another target, a
missing or broken model folder, a full context, ...) raises a UserError that says what to do. Front
ends show it as it is: the command line as one line and exit code 1, a server as a 4xx answer. Any
other exception is a bug. A UserError is a ValueError, and the two kinds about files are also the
OSError that callers may already catch.
"""


def unpaired_surrogate(text: str) -> int | None:
    """Where `text` holds an unpaired UTF-16 surrogate, if it does: no text holds one (UTF-8 cannot
    carry it). A str gets one from a JSON escape ("\\ud800"), or from bytes that were not UTF-8 read
    with surrogateescape (stdin, file names)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


class UserError(ValueError):
    """Bad input: the message says what is wrong and what to do."""


class NotFound(UserError, FileNotFoundError):
    """A file or folder the user named is not there (or is not what it should be)."""


class AlreadyExists(UserError, FileExistsError):
    """An output the user named is there already."""
