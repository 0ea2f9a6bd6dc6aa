"""Errors that are the user's to fix: the CLI shows their message without a traceback."""


class KvtoolError(Exception):
    """A mistake in the user's input or files. The message names the input, what is wrong and the fix."""


class PlanError(KvtoolError):
    """A plan directory that cannot be used (missing, truncated, edited, other format version)."""


class DatasetError(KvtoolError):
    """A dataset file with a malformed line (the message names the file and the line number)."""
