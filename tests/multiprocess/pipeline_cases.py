"""Shared pieces of the pipeline tests: models, data, a single-process reference, a distributed run.

The distributed run trains with ``tm.Trainer`` on a mesh with a ``pipe`` axis and returns, from
every process, the full value of each parameter it holds (names are global, so the test can merge
what the stages hold and compare it with one process).
"""

from __future__ import annotations

import contextlib

import torch

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 32, 8, 8, 3


def build_model(family: str, n_layer: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        from trainmesh.demo.char_gpt import CharGPT, GPTConfig

        return CharGPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=2, d_model=16))
    import transformers

    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=n_layer,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        )
        return transformers.LlamaForCausalLM(config).float()
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=n_layer,
        n_head=2,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.GPT2LMHeadModel(config).float()


def data(steps: int = STEPS):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * steps, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(outputs, targets):
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return _cross_entropy(logits, targets)


def _cross_entropy(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


LOSS_INPUTS: list[str] = []  # this process: the type of every output its loss function was handed


def model_output_loss(outputs, targets):
    """As a user writes it for a transformers model, with or without a pipeline: ``outputs.logits``;
    ``outputs[0]`` (a loss written for tuples) must read the same tensor."""
    LOSS_INPUTS.append(type(outputs).__name__)
    assert outputs[0] is outputs.logits, type(outputs)
    return _cross_entropy(outputs.logits, targets)


def tensor_loss(outputs, targets):
    """For a model that returns its logits as a tensor (the project's GPT)."""
    LOSS_INPUTS.append(type(outputs).__name__)
    return _cross_entropy(outputs, targets)


LOSSES = {"auto": lm_loss, "model_output": model_output_loss, "tensor": tensor_loss}


def output_type(family: str) -> str:
    """The type the model itself returns, which the loss function must get under any layout."""
    model = build_model(family, 2)
    with torch.no_grad():
        return type(model(data(1)[0][:2])).__name__


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(family: str, n_layer: int = 4, steps: int = STEPS, max_grad_norm=None) -> dict:
    model = build_model(family, n_layer)
    opt = make_optimizer(model.parameters())
    x, y = data(steps)
    losses = []
    for step in range(steps):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        loss = lm_loss(model(x[rows]), y[rows])
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)},
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "momentum": {k: opt.state[p]["momentum_buffer"].clone() for k, p in model.named_parameters()},
        "losses": losses,
    }


def local_full_params(model: torch.nn.Module) -> dict:
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = value.detach().cpu().clone()
    return out


def train_pipelined(
    family: str,
    mesh_shape,
    axes,
    schedule: str,
    *,
    microbatches: int = 4,
    zero_stage: int = 0,
    layout: bool = False,
    n_layer: int = 4,
    checkpointing=None,
    max_grad_norm=None,
    steps: int = STEPS,
    evaluate: bool = False,
    precision: str = "fp32",
    tol: float = 0.0,
    loss: str = "auto",
    state: bool = False,
) -> dict:
    import trainmesh as tm

    LOSS_INPUTS.clear()

    mesh = tm.DeviceMesh(mesh_shape, axes, devices=tm.list_devices())
    model = build_model(family, n_layer)
    pipeline = tm.Pipeline(axis="pipe", schedule=schedule, microbatches=microbatches)
    if layout or "model" in axes:
        layout_map = tm.LayoutMap.auto(model, mesh, model_axis="model", verbose=False)
        distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data", pipeline=pipeline)
    else:
        distribution = tm.DataParallel(device_mesh=mesh, pipeline=pipeline)
    trainer = tm.Trainer(
        model,
        make_optimizer,
        LOSSES[loss],
        distribution=distribution,
        zero_stage=zero_stage,
        activation_checkpointing=checkpointing,
        max_grad_norm=max_grad_norm,
        progress=False,
        log_every_n_steps=1,
        precision=precision,
        metrics=["accuracy"] if evaluate else None,
    )
    with count_reduce_scatters() as reduce_scatters:
        history = trainer.fit(data(steps), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    out = {
        "params": local_full_params(trainer.model),
        "loss": history.history["loss"][-1],
        "reduce_scatters": reduce_scatters[0],
        "fsdp_groups": fsdp_groups(trainer.model),
        "steps": steps,
        "steps_posted_ahead": [stage.steps_posted_ahead for stage in trainer.model._trainmesh_pipeline.stages],
    }
    if state:
        out.update(state_round_trip(trainer))
    if evaluate:
        logs = trainer.evaluate(data(1), batch_size=GLOBAL_BATCH)
        out["eval_loss"], out["eval_accuracy"] = logs["loss"], logs["accuracy"]
        out["predict"] = trainer.predict(data(1), batch_size=GLOBAL_BATCH)
    out["loss_inputs"] = sorted(set(LOSS_INPUTS))
    return out


def state_round_trip(trainer) -> dict:
    """``trainer.state_dict()`` (collective: every stage's model and optimizer state on the main
    process, ``{}`` elsewhere), then the weights and momentum moved and that state loaded back on
    every process, as ``load_checkpoint`` and a rollback load it: the stages must hold their saved
    values again."""
    import torch.distributed as dist

    saved = trainer.state_dict()
    box = [saved]
    dist.broadcast_object_list(box, src=0)
    with torch.no_grad():
        for param in trainer.model.parameters():
            (param.to_local() if hasattr(param, "to_local") else param).add_(1.0)
        for entry in trainer.optimizer.state.values():
            buffer = entry["momentum_buffer"]
            (buffer.to_local() if hasattr(buffer, "to_local") else buffer).add_(1.0)
    trainer.load_state_dict(box[0])
    again = trainer.state_dict()
    return {
        "state": saved["model"],
        "optimizer_state": saved["optimizer"],
        "reloaded_params": local_full_params(trainer.model),
        "reloaded_state": again["model"],
        "reloaded_optimizer_state": again["optimizer"],
    }


@contextlib.contextmanager
def count_reduce_scatters():
    """How many reduce-scatters FSDP2 issues inside the block (it calls ``reduce_scatter_single``, or on
    gloo trainmesh's ``AllReduceScatter``, which carries it by an all-reduce)."""
    import torch.distributed as dist

    from trainmesh.comm.allreduce_scatter import AllReduceScatter

    count, original, carried = [0], dist.reduce_scatter_single, AllReduceScatter.__call__

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    def counted_carried(self, *args, **kwargs):
        count[0] += 1
        return carried(self, *args, **kwargs)

    dist.reduce_scatter_single, AllReduceScatter.__call__ = counted, counted_carried
    try:
        yield count
    finally:
        dist.reduce_scatter_single, AllReduceScatter.__call__ = original, carried


def fsdp_groups(model: torch.nn.Module) -> int:
    """FSDP2 units holding parameters on this process: each reduce-scatters its gradients. A unit
    may span several modules (stages 1-2 on CPU group consecutive blocks), which share one state.
    A module of an FSDP class without a state of its own (a pipeline stage's copy of the sharded
    root; the state lives on the stage's model) stands for its unit."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fully_shard import _get_module_fsdp_state

    units = {id(_get_module_fsdp_state(m) or m) for m in model.modules() if isinstance(m, FSDPModule)}
    return len(units)


def merge(results: list[dict]) -> dict:
    merged: dict = {}
    for result in results:
        for name, value in result["params"].items():
            if name in merged:
                assert torch.equal(merged[name], value), f"two processes disagree on {name}"
            merged[name] = value
    return merged


def max_diff(expected: dict, got: dict, canonical: dict | None = None) -> float:
    worst = 0.0
    for name, value in got.items():
        ref = expected[canonical.get(name, name) if canonical else name]
        worst = max(worst, (ref - value).abs().max().item())
    return worst


def run_configs(configs: list[dict]) -> list[dict]:
    """Several pipelined trainings in one launch (process start-up is paid once); a config with
    ``refused=True`` must be refused when the Trainer is built (its message is returned)."""
    return [refusal(**config) if config.get("refused") else train_pipelined(**config) for config in configs]


def refusal(
    family: str,
    mesh_shape,
    axes,
    schedule: str,
    *,
    refused: bool,
    expect=(),
    n_layer: int = 4,
    microbatches: int = 2,
    checkpointing=None,
    compile=False,
) -> dict:
    """The ValueError a pipelined Trainer raises at construction, on every process alike."""
    import trainmesh as tm

    mesh = tm.DeviceMesh(mesh_shape, axes, devices=tm.list_devices())
    distribution = tm.DataParallel(device_mesh=mesh, pipeline=tm.Pipeline(schedule=schedule, microbatches=microbatches))
    try:
        tm.Trainer(
            build_model(family, n_layer),
            make_optimizer,
            lm_loss,
            distribution=distribution,
            activation_checkpointing=checkpointing,
            compile=compile,
            progress=False,
        )
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}


def reference_eval(family: str, params: dict, n_layer: int = 4) -> tuple[float, torch.Tensor]:
    """Loss and predictions of a one-process model holding ``params``, on the first global batch."""
    model = build_model(family, n_layer)
    model.load_state_dict(params, strict=False)
    x, y = data(1)
    with torch.no_grad():
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        return lm_loss(logits, y).item(), logits


class Interrupt(Exception):
    """Raised by every process at the same step: a crash after the last checkpoint."""


def train_with_checkpoints(
    layout: str, ckpt_dir: str, *, resume: bool, crash_at_step: int | None = None, epochs: int = 2, steps: int = 4
) -> dict:
    """The GPT with SGD-momentum under ``layout`` ("3d": pipe 2 x data 2 x model 2, "dp": data only),
    2 epochs of 4 shuffled steps, a sharded checkpoint every 2 steps (synchronous)."""
    import trainmesh as tm

    model = build_model("gpt")
    if layout == "3d":
        mesh = tm.DeviceMesh((2, 2, 2), ["pipe", "data", "model"], devices=tm.list_devices())
        layout_map = tm.LayoutMap.auto(model, mesh, model_axis="model", verbose=False)
        distribution = tm.ModelParallel(
            layout_map=layout_map, batch_dim_name="data", pipeline=tm.Pipeline(schedule="1f1b", microbatches=2)
        )
    else:
        distribution = tm.DataParallel()
    first_step: list = []  # the global step of the first step this run takes
    holder: list = []
    callbacks = [
        tm.ShardedCheckpoint(ckpt_dir, every_n_steps=2, async_save=False),
        tm.LambdaCallback(
            on_train_batch_begin=lambda step, logs: (
                first_step.append(holder[0].global_step + 1) if not first_step else None
            )
        ),
    ]
    if crash_at_step is not None:

        def crash(step, logs, trainer_steps=[0]):
            trainer_steps[0] += 1
            if trainer_steps[0] == crash_at_step:
                raise Interrupt()

        callbacks.append(tm.LambdaCallback(on_train_batch_begin=crash))
    trainer = tm.Trainer(
        model, make_optimizer, lm_loss, distribution=distribution, callbacks=callbacks, progress=False, seed=7
    )
    holder.append(trainer)
    try:
        trainer.fit(data(steps), epochs=epochs, batch_size=GLOBAL_BATCH, shuffle=True, resume=resume)
    except Interrupt:
        pass
    return {
        "params": local_full_params(trainer.unwrapped_model),
        "global_step": trainer.global_step,
        "first_step": first_step[0] if first_step else None,
    }
