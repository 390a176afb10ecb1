"""DeepSpeed's Ulysses for Hugging Face models (ALST: ``UlyssesSPAttentionHF``) on a transformers Llama, on
CPU/gloo: the peer side of ``long_context.py``'s ``cp_step_vs_deepspeed_ulysses``.

DeepSpeed's own pieces do the sequence parallelism: ``register_with_transformers`` builds its sequence
group (``parallel_state_sp``) and the attention wrapper (all-to-all from a sequence split to a head split
around the core attention, and back). What its engine would add for a data-parallel replica, the gradient
all-reduce over the group and the optimizer step, is written out here: one coalesced all-reduce of the
gradients (every process of the sequence group holds a partial gradient of the same replicated weights) and
the same torch AdamW trainmesh's side uses, so the two sides differ in the sequence parallelism only.

The batch is sharded as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` does it: labels shifted before the split,
contiguous sequence chunks (no head-tail balancing), global ``position_ids`` (its attention requires them).
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta


class DeepSpeedUlysses:
    """One sequence-parallel training loop over the whole world, DeepSpeed's Ulysses attention inside.

    ``register_with_transformers`` replaces transformers' ``sdpa`` entry for the whole process; the entry
    is put back at once and the wrapper installed only around this side's forward, so that trainmesh's side
    and one-process references in the same process keep plain sdpa.
    """

    def __init__(self, model, make_optimizer, *, seq: int, batch: int):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import torch
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.world = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        if seq % self.world:
            raise ValueError(f"sequence {seq} does not divide over {self.world} processes")
        # DeepSpeed's groups go through deepspeed.comm. Its init_distributed on the CPU accelerator first
        # builds the oneCCL backend (a JIT C++ extension build, minutes here); its torch backend wraps the
        # gloo group already started, which is what its own init does when no CCL backend exists
        from deepspeed.comm import comm as ds_comm
        from deepspeed.comm.torch import TorchBackend

        # the module, not deepspeed.comm's ``torch`` attribute (torch itself), which ``import as`` would bind
        ds_torch = sys.modules[TorchBackend.__module__]

        if ds_comm.cdb is None:
            # TorchBackend JIT-builds a shared-memory all-reduce op (ninja, C++) on the CPU accelerator: over
            # 4 minutes here under load, and Ulysses' all-to-alls never use it; gloo's own collectives serve
            build, ds_torch.build_shm_op = ds_torch.build_shm_op, lambda: None
            try:
                ds_comm.cdb = TorchBackend("gloo", timedelta(minutes=10), None)
            finally:
                ds_torch.build_shm_op = build
        self.functions = ALL_ATTENTION_FUNCTIONS
        before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=self.world,
            micro_batch_size=batch,
            seq_length=seq,
            seq_length_is_variable=False,
        )
        self.wrapper = ALL_ATTENTION_FUNCTIONS["sdpa"]
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(before)
        self.group = self.mpu.get_sequence_parallel_group()
        self.model = model
        self.model.train()
        self.optimizer = make_optimizer(model.parameters())
        self.seq, self.batch = seq, batch

    @contextlib.contextmanager
    def _attention(self):
        before = dict(self.functions._local_mapping)
        self.functions["sdpa"] = self.wrapper
        try:
            yield
        finally:
            self.functions._local_mapping.clear()
            self.functions._local_mapping.update(before)

    def step(self, x, y) -> float:
        """One AdamW step on the global batch ``(x, y)`` (labels already shifted); returns the global mean loss."""
        import torch

        rows, chunk = x.shape[0], self.seq // self.world
        part = slice(self.rank * chunk, (self.rank + 1) * chunk)
        positions = torch.arange(self.seq)[part].expand(rows, -1)
        with self._attention():
            logits = self.model(input_ids=x[:, part].contiguous(), position_ids=positions).logits
        loss_sum = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), y[:, part].reshape(-1), reduction="sum"
        )
        # each process holds a part of the global sum: the global mean's gradient is the sum of the parts
        (loss_sum / (rows * self.seq)).backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss_sum.detach().reshape(1)])
        torch.distributed.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return flat[-1].item() / (rows * self.seq)
