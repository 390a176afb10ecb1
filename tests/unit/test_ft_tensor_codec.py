"""trainmesh.ft.tensor_codec: the recovery state's wire format (no torchft needed): round trips of a real
model + AdamW + schedule state, a pickle (or anything that is not our JSON header) refused; and
ReplicaGroups' validation (no torchft needed either)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from trainmesh.ft.tensor_codec import UnsafeStateError, decode_state, encode_state, parse_header, tensor_specs

pytestmark = pytest.mark.timeout(60)


def _roundtrip(state):
    header, tensors = encode_state(state)
    received = [torch.empty(shape, dtype=dtype) for dtype, shape in tensor_specs(parse_header(header))]
    for out, sent in zip(received, tensors):
        out.reshape(-1).view(torch.uint8).copy_(sent.contiguous().reshape(-1).view(torch.uint8))  # as on the wire
    return decode_state(header, received)


def test_model_optimizer_and_schedule_state_round_trip_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "extra": {"bf16": torch.ones(3, dtype=torch.bfloat16), "flag": True, "none": None, 7: "int key"},
    }
    back = _roundtrip(state)
    assert back["model"].keys() == state["model"].keys()
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # betas stay a tuple
    assert back["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()  # int keys stay ints
    for key, slots in state["optimizer"]["state"].items():
        assert all(torch.equal(back["optimizer"]["state"][key][name], t) for name, t in slots.items())
    assert back["scheduler"] == state["scheduler"]
    assert back["extra"][7] == "int key" and back["extra"]["bf16"].dtype == torch.bfloat16
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    fresh.load_state_dict(back["optimizer"])  # torch accepts what came back


def test_a_pickle_or_torch_save_stream_is_refused_before_any_tensor():
    class Boom:
        def __reduce__(self):
            return (print, ("this must never run",))

    for payload in (pickle.dumps({"w": Boom()}), _torch_save_bytes(), b"", b"TMFT1not json", b"TMFT1[]"):
        with pytest.raises(UnsafeStateError):
            tensor_specs(parse_header(payload))


def test_a_header_naming_an_unknown_dtype_or_node_is_refused():
    header, _ = encode_state({"w": torch.ones(2)})
    with pytest.raises(UnsafeStateError):
        tensor_specs(parse_header(header.replace(b'"float32"', b'"object"')))
    with pytest.raises(UnsafeStateError):
        tensor_specs(parse_header(b'TMFT1{"tree": {"py": "os.system"}, "num_tensors": 0}'))


def test_sending_anything_but_tensors_and_plain_types_raises():
    with pytest.raises(TypeError, match="Received: object"):
        encode_state({"x": object()})


def _torch_save_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(1)}, buffer)
    return buffer.getvalue()


def test_replica_groups_config_says_what_it_received():
    from trainmesh.ft import ReplicaGroups

    assert ReplicaGroups(replica_group=1, lighthouse="http://127.0.0.1:1").quorum_retries == 3
    with pytest.raises(ValueError, match="min_replicas=0"):
        ReplicaGroups(replica_group=0, lighthouse="http://127.0.0.1:1", min_replicas=0)
    with pytest.raises(ValueError, match="replica_group=-1"):
        ReplicaGroups(replica_group=-1, lighthouse="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="timeout_s=0"):
        ReplicaGroups(replica_group=0, lighthouse="http://127.0.0.1:1", timeout_s=0)
