"""What the PS client's I/O keeps per call and per request: ``Gather`` (one API call waiting for a
reply from each of its messages), its ``DrivenFuture``, and the per-server request records."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from .protocol import Message
from .session import ClientSession


class DrivenFuture(Future):
    """A ``Future`` whose waiter reads the replies itself when no other thread is doing so.

    ``result``/``exception`` first call ``drive(self, timeout)`` (``ClientIO.drive``): a caller
    that waits on its own pushes receives their acks on its own thread, instead of sleeping
    until the I/O thread wakes, reads them and wakes it in turn (two thread hand-offs a request,
    each a scheduler round trip on a loaded machine). The base class does the rest."""

    def __init__(self, drive: Callable[["DrivenFuture", float | None], float | None] | None = None):
        super().__init__()
        self._drive = drive

    def result(self, timeout: float | None = None) -> Any:
        if self._drive is not None and not self.done():
            timeout = self._drive(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._drive is not None and not self.done():
            timeout = self._drive(self, timeout)
        return super().exception(timeout)


class Gather:
    """One API call: waits for a reply from each of its messages, then resolves ``future``."""

    def __init__(self, count: int, assemble: Callable[[list[Message]], Any] | None, drive=None):
        self.future: Future = DrivenFuture(drive)
        self.replies: list[Message | None] = [None] * count
        self.missing = count
        self.assemble = assemble
        if count == 0:
            self._finish()

    def deliver(self, slot: int, reply: Message) -> None:
        if self.future.done() or self.replies[slot] is not None:
            return
        self.replies[slot] = reply
        self.missing -= 1
        if self.missing == 0:
            self._finish()

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def _finish(self) -> None:
        try:
            result = self.assemble(self.replies) if self.assemble else None
        except BaseException as error:  # noqa: BLE001 - goes to the caller through the future
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


@dataclass
class Pending:
    gather: Gather
    slot: int
    kind: str
    msg: Message
    frame: list | None  # the encoded request's parts (large tensors are views of the caller's
    # memory); None until the connection has authenticated (it is sealed with the session token)
    first_sent: float
    sent: float
    interval: float


@dataclass
class ServerLink:
    name: str
    transport: Any = None
    next_seq: int = 1
    pending: dict[int, Pending] = field(default_factory=dict)
    session: ClientSession | None = None  # None: no secret, frames go unsealed (in-process tests)
