"""How a ``ParameterServerStrategy`` worker reaches the parameter servers: their addresses
(``TRAINMESH_PS_SERVERS``, else ``servers=``, else ``num_servers`` local servers that worker 0
starts and announces over the process group), the secret its frames are sealed with, and
stopping those local servers at the end.

A mixin apart from strategy.py because finding, securing and starting the servers is one
concept with its own collective (worker 0's broadcast of the addresses and secret), run on the
first use of ``client``. It uses the strategy's ``servers``, ``num_servers``, ``secret``,
``durability``, ``compression``, ``server_options``, ``client_options``, ``worker_id``,
``num_workers``, ``_client``, ``_cluster`` and ``_started_secret``, all set by
``ParameterServerStrategy.__init__``.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from .auth import resolve_secret

SERVERS_ENV = "TRAINMESH_PS_SERVERS"


class ServerConnection:
    """The strategy's connection to its servers (see the module docstring)."""

    def _connect(self) -> None:
        from .client import PSClient

        addresses = self._server_addresses()
        self._client = PSClient(
            servers=addresses,
            worker_id=self.worker_id,
            num_workers=self.num_workers,
            secret=self._secret_bytes(),
            compression=self.compression,
            **self.client_options,
        )

    def _secret_bytes(self) -> bytes | None:
        """``secret=``, else the job's (``TRAINMESH_PS_SECRET``, set by ``trainmesh run --servers``,
        or ``TRAINMESH_PS_SECRET_FILE``), else the one worker 0 made for the servers it started."""
        return resolve_secret(self.secret) or self._started_secret

    def _server_addresses(self) -> list[str]:
        raw = os.environ.get(SERVERS_ENV, "")
        if raw.strip():  # checked at the door: a bad port, empty host or repeat is named before any connection
            from trainmesh.runtime.addresses import parse_server_list

            return parse_server_list(raw, name=SERVERS_ENV)
        if self.servers is not None:
            return list(self.servers)
        holder: list[Any] = [None]
        if self.worker_id == 0:
            try:
                holder[0] = self._start_local_servers()
            except Exception as error:  # the others must not wait forever in the broadcast
                holder[0] = f"error: {type(error).__name__}: {error}"
        if self.num_workers > 1:
            import torch.distributed as dist

            # The servers' secret (a new one unless the user gave one) goes only to the job's own
            # processes, over their process group, with the addresses.
            dist.broadcast_object_list(holder, src=0)
        if isinstance(holder[0], str):
            raise RuntimeError(f"worker 0 could not start the parameter servers ({holder[0]})")
        addresses, secret = holder[0]
        self._started_secret = secret.encode("utf-8")
        return list(addresses)

    def _start_local_servers(self) -> tuple[list[str], str]:
        from .cluster import LocalCluster

        self._cluster = LocalCluster(
            self.num_servers or 1,
            num_workers=self.num_workers,
            durability=self.durability,
            secret=resolve_secret(self.secret),
            **self.server_options,
        )
        atexit.register(self._stop_cluster)
        return list(self._cluster.addresses), self._cluster.secret

    def _stop_cluster(self) -> None:
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.stop()
