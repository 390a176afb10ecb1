"""zero_memory.py's shared setup: the GPT model, its data, optimizer and loss, the two sides' precision
settings and ZeRO formulas per precision, and DeepSpeed's config (what this benchmark changes from its
defaults, and why).

It exists apart from the script because both sides' worker (``zero_memory_worker.py``) and the report
(``zero_memory_report.py``) read it: one definition of the work both sides do.
"""

from __future__ import annotations


import torch
from torch import nn
from torch.nn import functional as F


FULL_MODEL = {"vocab": 8192, "d_model": 640, "n_layer": 8, "n_head": 10, "seq": 128}
QUICK_MODEL = {"vocab": 4096, "d_model": 256, "n_layer": 4, "n_head": 4, "seq": 64}
MODEL_STATE_TOLERANCE = 0.10
LR = 1e-3


# --------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layer: int, n_head: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))  # trainmesh's shard units
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# What this benchmark changes from DeepSpeed's defaults, and why (printed with the results). Everything
# else, overlap_comm and contiguous_gradients included, is DeepSpeed's default for the stage
# (overlap_comm: off at stages 1-2, on at stage 3; the effective value is recorded per run).
# Both sides' processes run with the glibc malloc settings trainmesh.initialize applies on a CPU run
# (``trainmesh/runtime/host_allocator.py``: freed tensor memory is reused, not faulted in again each
# step); the DeepSpeed worker applies the same call before it starts, so the allocator is a setting
# both sides share, like the thread count. Recorded per variant as ``host_malloc``.
HOST_MALLOC = "the same glibc malloc settings on both sides (trainmesh/runtime/host_allocator.py)"
DS_CHANGES = {
    "reduce_bucket_size / allgather_bucket_size / stage3_prefetch_bucket_size": "set to trainmesh's largest FSDP unit of blocks at the stage (stages 1-2: blocks grouped up to 25 MB): the 5e8-element defaults would allocate a 1 GB bf16 (2 GB fp32) "
    "bucket per rank, 10x this model, and charge DeepSpeed's peak for an oversized buffer",
    "zero_allow_untested_optimizer": "the same torch.optim.Adam object trainmesh gets (not DeepSpeed's FusedAdam)",
}
# Per precision: DeepSpeed's precision block, trainmesh's gradient-reduction dtype at stages 1-3 and
# its settings that are not its defaults (with the reason; printed with the results), the ZeRO formula
# for that precision, and how closely the two systems' first-step losses (same model, seed and
# batches) must agree, else the two sides did different work and the comparison is INVALID.
PRECISIONS = {
    "bf16-mixed": {
        "ds_block": {"bf16": {"enabled": True}},
        "tm_reduce_dtype": "bf16",
        "tm_settings": {
            "reduce_dtype='bf16' (stages 1-3)": "DeepSpeed reduces gradients in communication_data_type, which defaults to bf16 under its bf16 "
            "config (engine.communication_data_type); trainmesh's default under bf16-mixed is fp32 (twice the "
            "bytes). Both sides reduce in bf16 here",
        },
        "zero_formula": "paper_2_2_12",
        # trainmesh autocasts over fp32 weights, DeepSpeed runs bf16 weights: bf16 rounding differs
        "loss_tolerance": 0.02,
        "what": "bf16 compute + fp32 master/Adam, gradients reduced in bf16",
    },
    "fp32": {
        "ds_block": {},  # no bf16/fp16 block: DeepSpeed's fp32 path; communication_data_type is then fp32
        "tm_reduce_dtype": None,  # FSDP2 reduces in the parameters' dtype, fp32
        "tm_settings": {},
        "zero_formula": "fp32_4_4_8",
        # The same fp32 weights, data and ops on both sides before the first update: the losses agree
        # to rounding (measured 5.6e-8 relative, one ulp, at every stage); 1e-5 leaves room for
        # summation order only, where any difference in the forward shows.
        "loss_tolerance": 1e-5,
        "what": "fp32 everything (params, grads, Adam m/v), gradients reduced in fp32",
    },
}


def choose_precision(requested: str) -> tuple[str, str]:
    """``(precision, why)``; ``auto`` asks the rule the demo uses (bf16 only where its matmuls pay)."""
    if requested != "auto":
        return requested, "given with --precision"
    from trainmesh.trainer.precision import fastest_precision

    precision, why = fastest_precision("cpu")
    return precision, f"auto: {why}"


def deepspeed_config(cfg: dict, stage: int, bucket: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}  # see DS_CHANGES
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket)
    return {
        "train_micro_batch_size_per_gpu": cfg["batch"] // cfg["nproc"],
        "gradient_accumulation_steps": 1,
        "train_batch_size": cfg["batch"],
        **PRECISIONS[cfg["precision"]]["ds_block"],
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def ds_bucket_elements(model: nn.Module, stage: int) -> int:
    """DeepSpeed's reduce / all-gather / prefetch bucket size, in elements. Its defaults (5e8) would
    allocate a 1 GB bf16 reduce bucket per rank at stage 3 (and in backward at stages 1-2), 10x this
    model; we give it the size of trainmesh's largest FSDP unit of blocks at that stage (a block at
    stage 3; at stages 1-2 on CPU processes trainmesh groups consecutive blocks up to 25 MB, see
    ``trainmesh._torch.zero.group_for_blocking_collectives``), or the largest single parameter if that
    is larger: the amount trainmesh reduce-scatters or gathers at once, so both sides reduce in
    buckets of the same size and neither is charged for an oversized buffer."""
    from trainmesh._torch.zero import group_for_blocking_collectives

    units = list(model.blocks)
    groups = group_for_blocking_collectives(units) if stage in (1, 2) else units

    def numel(unit):
        return sum(p.numel() for m in (unit if isinstance(unit, list) else [unit]) for p in m.parameters())

    return int(max(max(numel(g) for g in groups), max(p.numel() for p in model.parameters())))


def build_model(model_cfg: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # same seed -> identical initial weights in every variant
    return GPT(**model_cfg)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Adam without weight decay (the same update as AdamW with weight_decay=0). Not AdamW: trainmesh's
    # zero_stage=1 rebuilds the optimizer from ``optimizer.defaults``, and AdamW's defaults hold
    # ``decoupled_weight_decay``, which AdamW.__init__ rejects (TypeError at Trainer construction).
    return torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.0)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32 loss on both sides (autocast would do this for cross_entropy; DeepSpeed's bf16 logits would not)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One distinct global batch per step; identical on every process (same generator seed)."""
    m = cfg["model"]
    steps = cfg["mem_steps"] + cfg["warmup"] + cfg["steps"]
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    tokens = torch.randint(0, m["vocab"], (steps * cfg["batch"], m["seq"] + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
