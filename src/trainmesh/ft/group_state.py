"""A replica group of several processes: its rank's side of the cross-group sync and of recovery.

Inside a group any layout runs (ZeRO, TP, ...), so a parameter, its gradient and its optimizer state
may be a DTensor whose local shard is all this process holds. Across groups the same rank of each
group holds the same shard (the groups have the same layout), and torchft pairs them: each rank's
``manager.allreduce`` reaches the same rank of every other group, and a recovering rank receives
from the same rank of a live group. So everything that crosses groups is the local shard:

* ``local``: a tensor's local shard (the tensor itself when it is not a DTensor);
* ``local_tree``: a state dict with every DTensor replaced by its local shard (what the pickle-free
  transport carries: plain tensors only);
* ``load_model_local`` / ``load_optimizer_local``: a received state put back: model tensors copied
  into the shards in place; optimizer state loaded, then each per-parameter tensor wrapped back into
  a DTensor with its parameter's mesh and placements.

``group_store`` gives every rank of the group the address of one TCPStore its rank 0 serves, listening
on the advertised address only (torchft's Manager finds its group's manager server there). The address goes as a tensor over the group's own
process group: nothing is unpickled.
"""

from __future__ import annotations

import socket
from typing import Any

import torch

__all__ = ["local", "local_tree", "load_model_local", "load_optimizer_local", "group_store"]

_HOST_BYTES = 256


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this process holds (a view: writing it writes the DTensor)."""
    return tensor._local_tensor if isinstance(tensor, _dtensor_type()) else tensor


def local_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return local(value)
    if isinstance(value, dict):
        return {k: local_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_tree(v) for v in value)
    return value


def load_model_local(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a received state's shards into the model's, in place (same keys, same local shapes)."""
    own = model.state_dict()
    if own.keys() != state.keys():
        missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise ValueError(f"recovery state does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, tensor in own.items():
            target, source = local(tensor), state[name]
            if target.shape != source.shape:
                raise ValueError(
                    f"recovery state for {name} has shape {list(source.shape)}; this rank's shard is "
                    f"{list(target.shape)} (do the groups share one layout?)"
                )
            target.copy_(source)


def load_optimizer_local(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` with plain shards, then each state tensor shaped like its
    parameter's shard wrapped back into a DTensor like the parameter (scalars such as Adam's ``step``
    stay plain, as torch keeps them)."""
    optimizer.load_state_dict(state)
    dtensor = _dtensor_type()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, dtensor) or param not in optimizer.state:
                continue
            per_param = optimizer.state[param]
            shard_shape = param._local_tensor.shape
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, dtensor) and value.dim() > 0:
                    if value.shape == shard_shape:
                        per_param[key] = dtensor.from_local(
                            value,
                            param.device_mesh,
                            param.placements,
                            run_check=False,
                            shape=param.shape,
                            stride=param.stride(),
                        )


def group_store(advertise_host: str | None, timeout) -> tuple[Any, str, int]:
    """``(store or None, host, port)``: rank 0 of the group serves a TCPStore; every rank learns its
    address from rank 0 over the group's process group (one process: no collective)."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from trainmesh.ft.binding import bind_address, listening_socket

    group_world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if group_world > 1 else 0
    store, host, port = None, advertise_host or socket.gethostname(), 0
    if rank == 0:
        # on the advertised address only (a TCPStore master alone would listen on every interface)
        sock = listening_socket(bind_address(host))
        port = sock.getsockname()[1]
        store = TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=sock.fileno()
        )
        sock.detach()  # the store's server owns the descriptor now
    if group_world > 1:
        encoded = host.encode()
        if len(encoded) > _HOST_BYTES:
            raise ValueError(f"advertise_host is longer than {_HOST_BYTES} bytes. Received: {host!r}")
        message = torch.zeros(_HOST_BYTES + 1, dtype=torch.int64)
        if rank == 0:
            message[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.int64)
            message[-1] = port
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        message = message.to(device)
        dist.broadcast(message, src=0)
        message = message.cpu()
        port = int(message[-1])
        host = bytes(int(b) for b in message[:-1] if b != 0).decode()
    return store, host, port
