"""What a request must satisfy beyond decoding, and ``BadRequest``, the refusal it raises.

A request that decodes but cannot be served (a pull at a negative clock, a sync parameter on a
server that knows no worker count) is refused with a ``BadRequest``: ``ParameterServer.handle``
answers it with an ``error`` reply carrying its code and keeps serving. A mixin of
``ParameterServer`` (server.py), so dispatch reads as what each request does; it uses the
server's ``num_workers``, ``clocks``, ``server_id`` and ``state``, all set up by
``ParameterServer.__init__``. ``BadRequest`` lives here, not in server.py, so the other mixin
(server_pending.py) raises it without importing the module that imports it.
"""

from __future__ import annotations

from .protocol import Message


class BadRequest(ValueError):
    """A request that decoded but cannot be served; answered with an ``error`` reply."""

    def __init__(self, message: str, code: str = "bad_request"):
        super().__init__(message)
        self.code = code


class RequestChecks:
    """The checks ``ParameterServer._dispatch`` makes before it acts on a request."""

    def _expect_workers(self, msg: Message) -> None:
        """A client that knows the job's worker count tells it at registration (PSClient(num_workers=))."""
        count = msg.meta.get("num_workers")
        if count is None:
            return
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise BadRequest(f"register: num_workers must be an int >= 1, got {count!r}")
        if self.num_workers and count != self.num_workers:
            raise BadRequest(
                f"worker {msg.sender} says the job has {count} workers; this server was started "
                f"with --num-workers {self.num_workers}"
            )
        self.clocks.expect(count)

    def _check_sync_has_workers(self, msg: Message) -> None:
        """A sync round closes when every worker clocked past it: a server that knows no worker count
        would close round 0 as soon as the first worker clocked, before the others registered."""
        specs = msg.meta.get("params") or []
        sync = [s.get("name") for s in specs if isinstance(s, dict) and s.get("mode") == "sync"]
        if sync and not self.clocks.expected:
            raise BadRequest(
                f"sync mode for {sync} needs the number of workers before the first round: start "
                f"the server with --num-workers N, or pass num_workers= to PSClient "
                f"(ParameterServerStrategy does). Received: num_workers=0 on server {self.server_id}"
            )

    def _check_pull(self, msg: Message) -> None:
        clock = msg.meta.get("clock", 0)
        if not isinstance(clock, int) or isinstance(clock, bool) or clock < 0:
            raise BadRequest(f"pull clock must be an int >= 0, got {clock!r}")
        self.state.pull_consistency(msg)  # raises for unknown parameters, before queueing
