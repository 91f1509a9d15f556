"""User-facing errors: one line saying what is wrong, where (file/key) and what to do.

The CLI prints ``error: <message>`` for these and exits with code 2, without a traceback. Anything else
that escapes is a bug in gspo-ascend and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (config, data, paths, parallelism, environment) that the user can fix."""

    exit_code = 2


class ConfigError(UserError):
    """A config key, value or combination is invalid."""


class DeviceError(UserError):
    """The requested device is unknown or not usable on this machine."""


class Stopped(Exception):
    """The run stopped on a signal at a safe point (after a step, its checkpoint saved). The CLI prints
    ``stopped: <message>`` and exits with 128 + the signal number (143 for SIGTERM), as a process killed by
    that signal would, so schedulers that requeue on it still do."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class ClusterError(UserError):
    """A Ray node or a training worker process was lost mid-run. Not bad input, so exit code 1 (a failed run), but
    the same one line as a UserError (what was lost, where, what to do) instead of Ray's chained tracebacks."""

    exit_code = 1
