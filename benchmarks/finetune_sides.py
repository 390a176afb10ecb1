"""finetune.py's sides: the Llama and LoRA configurations, every side's loss and optimizer, the token batches,
and the sides themselves (``TrainerSide``: a ``tm.Trainer`` over a meta-built model; ``LoopSide``: the peer, a
peft model under DDP or Accelerate in a plain loop), built by name with ``build_side``.

It exists apart from the script because the workers (``finetune_workers.py``) and the parity run
(``finetune_parity.py``) both read it: one definition of the work every side does. ``UPCAST_LOSS`` lives here,
beside ``lm_loss`` that reads it; an ``-upcast`` memory worker sets it as ``finetune_sides.UPCAST_LOSS``.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from trainmesh.losses import lm_cross_entropy

WORLD = 4
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0)
LR = 1e-4
DDP_KWARGS = {"gradient_as_bucket_view": True}
UPCAST_LOSS = False  # set in the fresh processes of an "-upcast" memory side


# --------------------------------------------------------------------------- model, data, sides
def llama_config(size: dict):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        max_position_embeddings=max(256, size["seq"]),
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def lora_config(init=True):
    import peft

    return peft.LoraConfig(target_modules=TARGET_MODULES, init_lora_weights=init, task_type="CAUSAL_LM", **LORA)


def lm_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Every side's loss (the Trainer's and the peers' loops): trainmesh's ``lm_cross_entropy`` on whole logits,
    fp32 a block of rows at a time (no fp32 copy of the logits). A plain function, not ``lm_cross_entropy``
    itself, so the TP parity run computes it on whole logits as the one-process reference does. ``-upcast``
    memory sides use the path it replaced, ``F.cross_entropy(logits.float())``."""
    if UPCAST_LOSS:
        logits = outputs.logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return lm_cross_entropy(outputs, targets)


def make_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR, weight_decay=0.0)


def token_data(size: dict, batches: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batches`` global batches of ``rows x WORLD`` sequences, identical on every process."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, size["vocab"], (batches * size["rows"] * WORLD, size["seq"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class TrainerSide:
    """A ``tm.Trainer``; ``run`` trains ``n`` global batches with one ``fit`` and times its steps."""

    def __init__(self, cfg: dict, lora: bool, stage: int, keep_frozen_gathered="auto"):
        import transformers

        import trainmesh as tm
        from trainmesh.trainer.callbacks import Callback

        class Clock(Callback):
            marks: list[float] = []

            def on_train_batch_end(self, step, logs=None):
                self.marks.append(time.perf_counter())

        self.clock = Clock()
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(llama_config(cfg["size"]))
            if lora:
                import peft

                model = peft.get_peft_model(model, lora_config())
        self.trainer = tm.Trainer(
            model,
            make_adamw,
            lm_loss,
            distribution=tm.DataParallel(zero_stage=stage, keep_frozen_gathered=keep_frozen_gathered),
            weights=cfg["base_dir"],
            precision=cfg["precision"],
            progress=False,
            callbacks=[self.clock],
        )
        self.batch = cfg["size"]["rows"] * WORLD

    def run(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[float]]:
        self.clock.marks = []
        start = time.perf_counter()
        history = self.trainer.fit((x, y), epochs=self.trainer.epoch + 1, batch_size=self.batch, shuffle=False)
        marks = [start] + self.clock.marks
        n = len(x) // self.batch
        return [b - a for a, b in zip(marks, marks[1:])], [r["loss"] for r in history.steps[-n:]]


class LoopSide:
    """The peer: a peft model under DDP (or Accelerate), a plain loop over this process's rows."""

    def __init__(self, cfg: dict, kind: str):
        import peft
        import torch.distributed as dist
        import transformers

        transformers.utils.logging.disable_progress_bar()
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg["base_dir"], dtype=torch.float32)
        model = peft.get_peft_model(model, lora_config())
        optimizer = make_adamw(model.parameters())
        bf16 = cfg["precision"] == "bf16-mixed"
        self.rank, self.rows = dist.get_rank(), cfg["size"]["rows"]
        if kind == "accelerate":
            from accelerate import Accelerator
            from accelerate.utils import DistributedDataParallelKwargs

            self.accelerator = Accelerator(
                cpu=True,
                mixed_precision="bf16" if bf16 else "no",
                kwargs_handlers=[DistributedDataParallelKwargs(**DDP_KWARGS)],
            )
            assert self.accelerator.num_processes == WORLD, self.accelerator.state
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
            self.backward, self.autocast = self.accelerator.backward, contextlib.nullcontext
        else:
            self.model = torch.nn.parallel.DistributedDataParallel(model, **DDP_KWARGS)
            self.optimizer = optimizer
            self.backward = lambda loss: loss.backward()
            self.autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def run(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[float]]:
        batch, local = self.rows * WORLD, []
        times, last = [], time.perf_counter()
        for k in range(len(x) // batch):
            rows = slice(k * batch + self.rank * self.rows, k * batch + (self.rank + 1) * self.rows)
            with self.autocast():
                outputs = self.model(x[rows])
            loss = lm_loss(outputs, y[rows])
            self.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            local.append(loss.detach())
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times, [float(v) for v in local]  # this process's losses; averaged over processes later


def build_side(cfg: dict, side: str):
    if side == "tm-full":
        return TrainerSide(cfg, lora=False, stage=3)
    if side == "tm-lora":
        return TrainerSide(cfg, lora=True, stage=3)
    if side == "tm-lora-dp":
        return TrainerSide(cfg, lora=True, stage=0)
    if side == "tm-lora-regather":
        return TrainerSide(cfg, lora=True, stage=3, keep_frozen_gathered=False)
    return LoopSide(cfg, side)
