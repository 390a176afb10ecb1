"""Communication helpers shared by the training loop: progress beacons and hang diagnosis."""

from .diagnosis import CollectiveTimeoutError, ProgressBeacon

__all__ = ["CollectiveTimeoutError", "ProgressBeacon"]
