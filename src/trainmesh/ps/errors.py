"""Errors a parameter-server client raises to its caller."""

from __future__ import annotations


class PSError(RuntimeError):
    """A server answered a request with an error, or the client could not complete it."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


class PSTimeoutError(PSError, TimeoutError):
    """A request could not complete in time: a sync pull waiting on a dead worker, or no reply."""

    def __init__(self, message: str, code: str = "timeout", worker: str | None = None):
        super().__init__(message, code)
        self.worker = worker


class PSAuthError(PSError):
    """A server rejected this client's frames: its secret is missing or not the servers' one."""
