"""Activation checkpointing policies: exact gradients, unchanged names, real recomputation, real savings."""

from __future__ import annotations

import copy
import gc
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from trainmesh._torch.activation_checkpointing import apply_activation_checkpointing, checkpointed_module_paths

pytestmark = pytest.mark.timeout(120)

BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32, heads: int = 4, n_blocks: int = 4, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_transformer(**kw) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(**kw)


def make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def transformer_batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 32, (4, 16), generator=g),)


def mlp_batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(8, 16, generator=g),)


CASES = {
    # model factory, batch, {policy: expected paths}
    "transformer": (
        make_transformer,
        transformer_batch,
        {
            "full": BLOCKS,
            "every:2": ["blocks.0", "blocks.2"],
            "selective": BLOCKS,
            r"blocks\.\d+\.mlp": [f"{b}.mlp" for b in BLOCKS],
        },
    ),
    "mlp": (
        make_mlp,
        mlp_batch,
        {"full": ["0", "2", "4", "6"], "every:2": ["0", "4"], "selective": ["0", "2", "4", "6"], r"[24]": ["2", "4"]},
    ),
}
PARAMS = [(name, policy) for name, (_, _, policies) in CASES.items() for policy in policies]


def step(model, batch, seed: int = 123):
    """One forward + backward; -> (output, {name: grad})."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(*batch)
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def count_calls(model, paths):
    """Forward pre-hooks counting calls (pre-hooks: recomputation may stop early, before forward hooks)."""
    counts = dict.fromkeys(paths, 0)
    modules = dict(model.named_modules())
    for path in paths:

        def hook(module, args, path=path):
            counts[path] += 1

        modules[path].register_forward_pre_hook(hook)
    return counts


@pytest.mark.parametrize("case,policy", PARAMS)
def test_outputs_and_gradients_identical_and_names_unchanged(case, policy):
    factory, batch_fn, expected = CASES[case]
    plain, ckpt = factory(), factory()
    names = [n for n, _ in ckpt.named_parameters()]
    keys = list(ckpt.state_dict())
    module_paths = [p for p, _ in ckpt.named_modules()]

    assert checkpointed_module_paths(ckpt, policy) == expected[policy]
    assert apply_activation_checkpointing(ckpt, policy) is ckpt

    assert [n for n, _ in ckpt.named_parameters()] == names
    assert list(ckpt.state_dict()) == keys
    assert [p for p, _ in ckpt.named_modules()] == module_paths
    ckpt.load_state_dict(plain.state_dict())  # keys load both ways, strictly
    plain.load_state_dict(ckpt.state_dict())

    batch = batch_fn()
    out0, grads0 = step(plain, batch)
    out1, grads1 = step(ckpt, batch)
    assert torch.equal(out0, out1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert torch.allclose(grads0[name], grads1[name], rtol=0, atol=1e-7), name


@pytest.mark.parametrize("case,policy", PARAMS)
def test_recomputation_happens_exactly_where_the_policy_says(case, policy):
    factory, batch_fn, expected = CASES[case]
    model = factory()
    all_paths = expected["full"] + [p for p in expected[policy] if p not in expected["full"]]
    apply_activation_checkpointing(model, policy)
    counts = count_calls(model, all_paths)
    step(model, batch_fn())
    assert counts == {p: 2 if p in expected[policy] else 1 for p in all_paths}

    plain = factory()
    counts = count_calls(plain, all_paths)
    step(plain, batch_fn())
    assert set(counts.values()) == {1}


def test_no_grad_and_eval_do_not_recompute():
    model = apply_activation_checkpointing(make_transformer(), "full")
    with torch.no_grad():
        model(*transformer_batch())
    assert [b.calls for b in model.blocks] == [1, 1, 1, 1]


def test_none_policy_is_a_no_op():
    model = make_transformer()
    assert checkpointed_module_paths(model, None) == []
    assert apply_activation_checkpointing(model, None) is model
    step(model, transformer_batch())
    assert [b.calls for b in model.blocks] == [1, 1, 1, 1]


def test_regex_wraps_only_the_outermost_of_nested_matches():
    model = make_transformer()
    assert checkpointed_module_paths(model, r"blocks\.[13](\..*)?") == ["blocks.1", "blocks.3"]
    apply_activation_checkpointing(model, r"blocks\.[13](\..*)?")
    step(model, transformer_batch())
    assert [b.calls for b in model.blocks] == [1, 2, 1, 2]


def test_applying_twice_does_not_double_wrap():
    model = make_transformer()
    apply_activation_checkpointing(model, "full")
    hooks = [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks]
    assert apply_activation_checkpointing(model, "full") is model
    assert [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks] == hooks
    step(model, transformer_batch())
    assert [b.calls for b in model.blocks] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match=r"already has activation_checkpointing='full'.*Received: policy='every:2'"):
        apply_activation_checkpointing(model, "every:2")


def test_dropout_masks_are_replayed_so_gradients_stay_identical():
    plain, ckpt = make_transformer(dropout=0.2), make_transformer(dropout=0.2)
    apply_activation_checkpointing(ckpt, "full")
    out0, grads0 = step(plain, transformer_batch())
    out1, grads1 = step(ckpt, transformer_batch())
    assert torch.equal(out0, out1)
    for name in grads0:
        assert torch.allclose(grads0[name], grads1[name], rtol=0, atol=1e-7), name


class KwargsBlock(nn.Module):
    """Takes keyword arguments and returns a tuple, as many library blocks do."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.calls = 0

    def forward(self, x, *, scale: float = 1.0, mask=None):
        self.calls += 1
        h = F.gelu(self.fc1(x)) * scale
        if mask is not None:
            h = h * mask
        y = x + self.fc2(h)
        return y, {"aux": (h**2).mean()}


class KwargsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(KwargsBlock(8) for _ in range(3))

    def forward(self, x, mask):
        aux = 0
        for layer in self.layers:
            x, extra = layer(x, scale=0.5, mask=mask)
            aux = aux + extra["aux"]
        return x.sum(-1) + aux


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_kwargs_and_tuple_outputs(policy):
    torch.manual_seed(0)
    plain = KwargsModel()
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, policy)
    batch = (torch.randn(4, 8), (torch.rand(4, 16) > 0.3).float())
    out0, grads0 = step(plain, batch)
    out1, grads1 = step(ckpt, batch)
    assert torch.equal(out0, out1)
    for name in grads0:
        assert torch.allclose(grads0[name], grads1[name], rtol=0, atol=1e-7), name
    assert [layer.calls for layer in ckpt.layers] == [2, 2, 2]


def test_meta_device_model_for_the_planner():
    with torch.device("meta"):
        model = TinyTransformer()
    assert checkpointed_module_paths(model, "every:2") == ["blocks.0", "blocks.2"]
    apply_activation_checkpointing(model, "selective")
    out = model(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    out.sum().backward()
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


# --- memory: bytes held for backward after the forward -------------------------------------------


class _RecordStorages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                s = t.untyped_storage()
                self.refs.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out


def activation_bytes(model, batch) -> int:
    """Bytes of forward-produced storages still alive when only the loss is kept: what autograd,
    checkpoint frames and selective-checkpoint caches hold for backward (whatever mechanism)."""
    model.zero_grad(set_to_none=True)
    rec = _RecordStorages()
    with rec:
        loss = (model(*batch) ** 2).mean()
    gc.collect()
    held = sum(n for ref, n in rec.refs.values() if not ref.expired())
    loss.backward()  # and the graph still works
    return held


def saved_tensor_hook_bytes(model, batch) -> int:
    """Bytes packed by saved_tensors_hooks outside checkpointed regions (checkpoint's own hooks
    take precedence inside them, so this undercounts what checkpointing keeps)."""
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = (model(*batch) ** 2).mean()
    loss.backward()
    return sum(seen.values())


def measure(policy, factory=lambda: make_transformer(d=64), batch=lambda: (torch.randint(0, 32, (4, 32)),)):
    model = factory()
    apply_activation_checkpointing(model, policy)
    return activation_bytes(model, batch())


def test_full_and_selective_save_activation_memory():
    none, selective, every2, full = (measure(p) for p in (None, "selective", "every:2", "full"))
    print(
        f"\nactivation bytes: none={none} selective={selective} ({selective / none:.3f}) "
        f"every:2={every2} ({every2 / none:.3f}) full={full} ({full / none:.3f})"
    )
    assert full < selective < none
    assert full < every2 < none
    assert full / none < 0.5  # 4 blocks dominate: keeping only their inputs is far smaller
    assert selective / none < 0.9


def test_saved_tensors_hook_view_counts_fewer_bytes_with_checkpointing():
    def hook_bytes(policy):
        model = make_transformer(d=64)
        apply_activation_checkpointing(model, policy)
        return saved_tensor_hook_bytes(model, (torch.randint(0, 32, (4, 32)),))

    none, full = hook_bytes(None), hook_bytes("full")
    assert full < none * 0.5


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["every:0", "every:x", "every:", "every:-1", "every", "", 2, True, ["full"]])
def test_bad_policies_raise(policy):
    with pytest.raises(ValueError, match="Received: policy="):
        checkpointed_module_paths(make_mlp(), policy)
    with pytest.raises(ValueError, match="Received: policy="):
        apply_activation_checkpointing(make_mlp(), policy)


def test_invalid_regex_raises():
    bad = r"blocks\.("
    with pytest.raises(ValueError, match="not a valid regex.*" + re.escape(f"Received: policy={bad!r}")):
        apply_activation_checkpointing(make_transformer(), bad)


def test_regex_without_match_names_the_regex_and_example_paths():
    with pytest.raises(ValueError, match=re.escape(repr(r"layers\.\d+")) + ".*Example paths: 'embed', 'blocks'"):
        apply_activation_checkpointing(make_transformer(), r"layers\.\d+")


def test_model_without_blocks_suggests_a_regex():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    for policy in ("full", "every:2", "selective"):
        with pytest.raises(ValueError, match="Flat has none. Pass a regex"):
            apply_activation_checkpointing(Flat(), policy)
    apply_activation_checkpointing(Flat(), "a")  # a regex works


# --- DTensor parameters (tensor parallel) and FSDP2, on a one-process gloo group -----------------


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # the test model's head returns a view
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_dtensor_parameters_and_fsdp2_compose(one_process_group, policy):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = one_process_group
    batch = transformer_batch()
    out0, grads0 = step(make_transformer(), batch)

    tp = make_transformer()
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }
    for block in tp.blocks:
        parallelize_module(block, mesh, plan)
    names = [n for n, _ in tp.named_parameters()]
    apply_activation_checkpointing(tp, policy)  # torchtitan's order: TP, then AC, then FSDP
    assert [n for n, _ in tp.named_parameters()] == names
    assert isinstance(tp.blocks[0].mlp[0].weight, DTensor)

    fsdp = make_transformer()
    apply_activation_checkpointing(fsdp, policy)
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)

    for model in (tp, fsdp):
        out1, grads1 = step(model, batch)
        assert torch.equal(out0, out1)
        for name, grad in grads1.items():
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            assert torch.allclose(grads0[name], grad, rtol=0, atol=1e-7), name
        assert [b.calls for b in model.blocks] == [2, 2, 2, 2]
