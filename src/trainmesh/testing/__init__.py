"""Helpers for testing distributed code on real process groups (shipped for users too)."""

from .harness import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
