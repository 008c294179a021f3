"""The one error family of reslab: every error a user can cause is a `ReslabError` with an exit code.

The CLI maps `ReslabError.exit_code` to the process exit status and prints the message as one line;
anything else that escapes is a bug and keeps its traceback. This module is a leaf (no imports from
reslab), so every layer, the lowest included, can raise these.
"""

from __future__ import annotations


class ReslabError(Exception):
    """Base of every error a user can cause; the message says what was wrong and what is allowed."""

    exit_code = 2


class ConfigError(ReslabError, ValueError):
    """A configuration value is wrong; the message names the field path and what is allowed."""


class RunFailed(ReslabError, RuntimeError):
    """A run ended without a result (diverged, crashed); the study goes on, the exit status says so."""

    exit_code = 1
