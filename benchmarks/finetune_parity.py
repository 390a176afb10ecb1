"""finetune.py's parity run: a small Llama with LoRA trained under ``ModelParallel`` (a (2, 2) mesh,
``LayoutMap.auto``) and under ZeRO-3 in 4 fresh processes (``parity_run``), against a plain one-process peft
loop over the same batches (``parity_reference``), with SGD for the figure and AdamW for context, and the
largest adapter differences (``parity_summary``).

It exists apart from the script because it checks what the layouts compute, not what they cost: its own
model, optimizers and processes, sharing only the loss and the batches (``finetune_sides.py``).
"""

from __future__ import annotations

import contextlib
import io

import torch

from finetune_sides import WORLD, llama_config, lm_loss, lora_config, token_data

PARITY_SIZE = dict(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, vocab=128, seq=16, rows=2)
PARITY_STEPS, PARITY_LR = 10, 1e-2


def parity_model(seed: int = 0):
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(PARITY_SIZE)).float()
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(model, lora_config(init=False))  # lora_B random: every adapter moves from step 1


def parity_optimizer(params, kind: str = "sgd") -> torch.optim.Optimizer:
    """SGD with momentum for the figure (as ``tests/multiprocess/lora_cases.make_sgd``); AdamW for context.
    AdamW divides each coordinate's step by its own running gradient size, which blows summation-order noise up:
    one process, the same 10 batches split into 4 micro-batches, moves its adapters by ~8e-5 (reported as
    ``adamw_microbatch_noise_1proc``), so a 1e-5 bound would measure the optimizer, not the layout."""
    params = [p for p in params if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=PARITY_LR, weight_decay=0.01, eps=1e-5)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def parity_run() -> dict:
    """The parity trainings (fresh processes: ``main`` launches them after the timing); adapters on rank 0."""
    import trainmesh as tm

    x, y = token_data(PARITY_SIZE, PARITY_STEPS, 5)
    out = {}
    for kind in ("sgd", "adamw"):
        for layout in ("tp2x2", "zero3"):
            model, distribution, stage = parity_model(), None, 3
            if layout == "tp2x2":
                mesh = tm.DeviceMesh((2, 2), ["data", "model"], devices=tm.list_devices())
                distribution = tm.ModelParallel(
                    layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data"
                )
                stage = None
            with contextlib.redirect_stdout(io.StringIO()):
                trainer = tm.Trainer(
                    model,
                    lambda p, kind=kind: parity_optimizer(p, kind),
                    lm_loss,
                    distribution=distribution,
                    zero_stage=stage,
                    precision="fp32",
                    progress=False,
                )
                trainer.fit((x, y), epochs=1, batch_size=PARITY_SIZE["rows"] * WORLD, shuffle=False)
            state = trainer.state_dict()["model"]
            sharded = sum(
                1
                for p in trainer.model.parameters()
                if getattr(p, "placements", None) and any(pl.is_shard() for pl in p.placements)
            )
            out[f"{kind}/{layout}"] = {
                "state": {k: v.detach().clone() for k, v in state.items()} if tm.rank() == 0 else None,
                "sharded_params": sharded,
            }
    return out


def parity_reference(kind: str, micro_batches: int = 1) -> tuple[dict, dict]:
    """(start, end) state of a plain one-process peft loop over the same global batches."""
    model = parity_model()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = parity_optimizer(model.parameters(), kind)
    x, y = token_data(PARITY_SIZE, PARITY_STEPS, 5)
    batch = PARITY_SIZE["rows"] * WORLD
    for k in range(PARITY_STEPS):
        optimizer.zero_grad()
        for m in range(micro_batches):
            rows = slice(k * batch + m * batch // micro_batches, k * batch + (m + 1) * batch // micro_batches)
            (lm_loss(model(x[rows]), y[rows]) / micro_batches).backward()
        optimizer.step()
    return start, {k: v.detach().clone() for k, v in model.state_dict().items()}


def parity_summary(got: dict) -> dict:
    def adapter_diff(a: dict, b: dict) -> float:
        return max((a[k] - v).abs().max().item() for k, v in b.items() if "lora_" in k)

    out = {
        "max_abs_diff": {},
        "adamw_max_abs_diff": {},
        "frozen_unchanged": True,
        "tp_sharded_params": got["sgd/tp2x2"]["sharded_params"],
    }
    for kind in ("sgd", "adamw"):
        start, expected = parity_reference(kind)
        for layout in ("tp2x2", "zero3"):
            state = got[f"{kind}/{layout}"]["state"]
            assert state.keys() == expected.keys(), (kind, layout)
            out["max_abs_diff" if kind == "sgd" else "adamw_max_abs_diff"][layout] = adapter_diff(state, expected)
            out["frozen_unchanged"] &= all(torch.equal(state[k], start[k]) for k in start if "lora_" not in k)
        if kind == "sgd":
            out["adapters_moved"] = adapter_diff(expected, start)
        else:
            out["adamw_microbatch_noise_1proc"] = adapter_diff(parity_reference(kind, micro_batches=4)[1], expected)
    return out
