"""torchft's recovery transport without pickle: a recovering group receives the live state as a JSON
header plus raw tensor bytes over the replica groups' own gloo process group (``tensor_codec``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from trainmesh.ft.tensor_codec import decode_state, encode_state, parse_header, tensor_specs

__all__ = ["SafeStateTransport"]


def _build_transport_class():
    from torchft.checkpointing.transport import CheckpointTransport

    class _SafeStateTransport(CheckpointTransport):
        """torchft's ``CheckpointTransport`` over the replica groups' own process group, without pickle:
        a length, a JSON header (``tensor_codec``), then each tensor's bytes, each send a tagged gloo
        message. The receiver checks the header before it allocates anything."""

        def __init__(self, pg: Any, timeout: timedelta) -> None:
            self._pg = pg
            self._timeout = timeout

        def metadata(self) -> str:
            return "trainmesh-json-v1"  # no address: the bytes go over the quorum's process group

        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
            header, tensors = encode_state({"step": step, "state": state_dict})
            header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            length = torch.tensor([len(header)], dtype=torch.int64)
            for dst in dst_ranks:
                self._pg.send([length], dst, tag=1).wait(timeout)
                self._pg.send([header_t], dst, tag=2).wait(timeout)
                for i, tensor in enumerate(tensors):
                    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                    self._pg.send([raw], dst, tag=3 + i).wait(timeout)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            length = torch.zeros(1, dtype=torch.int64)
            self._pg.recv([length], src_rank, tag=1).wait(timeout)
            header_t = torch.empty(int(length.item()), dtype=torch.uint8)
            self._pg.recv([header_t], src_rank, tag=2).wait(timeout)
            header = header_t.numpy().tobytes()
            specs = tensor_specs(parse_header(header))  # refuses a pickle before any tensor is received
            tensors = []
            for i, (dtype, shape) in enumerate(specs):
                out = torch.empty(shape, dtype=dtype)
                self._pg.recv([out.reshape(-1).view(torch.uint8)], src_rank, tag=3 + i).wait(timeout)
                tensors.append(out)
            received = decode_state(header, tensors)
            if received["step"] != step:
                raise ValueError(f"recovery state is for step {received['step']}. Expected: step={step}")
            return received["state"]

    return _SafeStateTransport


def SafeStateTransport(pg: Any, timeout: timedelta) -> Any:  # noqa: N802 (a class built on first use)
    """torchft ``CheckpointTransport`` without pickle (built lazily: torchft is optional)."""
    return _build_transport_class()(pg, timeout)
