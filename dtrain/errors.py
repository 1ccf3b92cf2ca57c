"""User-facing errors and exit codes.

Library code raises `DtrainError` (or a subclass) with a message that says what went
wrong and a hint that says what to do next. The CLI is the one place that turns them
into a one-line message and an exit code; tracebacks only with `--traceback`.
"""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2  # the same code click uses for bad command lines
    CONFIG = 3
    PREFLIGHT = 4
    JOB_FAILED = 5
    INTERRUPTED = 130


class DtrainError(Exception):
    """An error the user can act on; never shown with a traceback."""

    exit_status: ExitStatus = ExitStatus.ERROR

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(DtrainError):
    exit_status = ExitStatus.CONFIG


class PreflightError(DtrainError):
    exit_status = ExitStatus.PREFLIGHT


class JobFailed(DtrainError):
    exit_status = ExitStatus.JOB_FAILED
