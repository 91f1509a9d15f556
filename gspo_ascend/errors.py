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
