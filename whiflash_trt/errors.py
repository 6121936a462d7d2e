"""User-facing errors: the CLIs print their message and exit non-zero, without a traceback."""


class WhiflashError(Exception):
    """An error a user can act on (bad input, missing files); the message says what and how."""


class CheckpointError(WhiflashError):
    """A checkpoint or engine directory is missing, incomplete, corrupt, or does not match its config."""
