"""Errors a user can fix. The CLI prints their message and exits non-zero, without a traceback."""


class UserError(Exception):
    """Bad input: a wrong option, a missing or unreadable file, an incompatible checkpoint.

    The message must say what was wrong, where (file or option), and what to do.
    """

    exit_code = 2
