"""zero_memory.py's worker: one variant (a system at a ZeRO stage) in one process of the torchrun job the
script starts (``zero_memory.py --worker VARIANT``): build, instrumented steps for memory, warmup, timed
steps, and this rank's numbers written as JSON.

It exists apart from the script because it runs inside the measured processes, the script outside them.
"""

from __future__ import annotations

import gc
import json
import math
import time

import torch
import torch.distributed as torch_dist

from trainmesh.runtime.host_allocator import host_malloc_setting
from trainmesh.testing.memory import LiveTensorBytes

from zero_memory_instruments import count_deepspeed_state, count_trainmesh_state, proc_status_kb, reset_hwm
from zero_memory_setup import (
    PRECISIONS,
    build_model,
    deepspeed_config,
    ds_bucket_elements,
    loss_fn,
    make_data,
    make_optimizer,
)


# --------------------------------------------------------------------------- the worker (one variant)
def _barrier_time() -> float:
    torch_dist.barrier()
    return time.perf_counter()


def worker(cfg: dict, variant: str, out_path: str) -> None:
    system, stage = variant.rsplit("-", 1)
    stage = int(stage)
    torch.set_num_threads(1)
    tracker = LiveTensorBytes()
    tracker.__enter__()  # before anything is built: every tensor of the run is seen from its creation
    x, y = make_data(cfg)
    model = build_model(cfg["model"], cfg["seed"])
    num_params = sum(p.numel() for p in model.parameters())
    info: dict = {"state_at_step": []}
    mem_steps, warmup, steps = cfg["mem_steps"], cfg["warmup"], cfg["steps"]
    total_steps = mem_steps + warmup + steps
    step_times: list[float] = []
    cpu_times: list[float] = []  # this process's CPU seconds per step (all its threads): work, not waiting
    losses: list[float] = []
    phase = {"step": 0}

    def end_memory_phase() -> None:
        info["peak_live"] = tracker.peak
        info["live_end"] = tracker.live
        info["vm_hwm_kb"] = proc_status_kb("VmHWM")
        tracker.__exit__(None, None, None)

    if system == "trainmesh":
        import trainmesh as tm
        from trainmesh.trainer.callbacks import Callback

        tm.initialize()
        rank, world = tm.rank(), tm.world_size()

        class Clock(Callback):
            def on_train_begin(self, logs=None):
                setup_done()

            def on_train_batch_begin(self, step, logs=None):
                self.t0 = _barrier_time()
                self.c0 = time.process_time()

            def on_train_batch_end(self, step, logs=None):
                cpu_times.append(time.process_time() - self.c0)
                step_times.append(_barrier_time() - self.t0)
                losses.append(float((logs or {}).get("loss", math.nan)))
                phase["step"] += 1
                if phase["step"] == mem_steps:
                    end_memory_phase()

        # Under bf16-mixed, gradients reduced in bf16 at stages 1-3, as DeepSpeed's default
        # communication_data_type does under its bf16 config (see PRECISIONS); stage 0 (DDP) reduces
        # autocast's fp32 gradients. Under fp32 both sides reduce in fp32, their defaults.
        reduce_dtype = PRECISIONS[cfg["precision"]]["tm_reduce_dtype"]
        distribution = tm.DataParallel(reduce_dtype=reduce_dtype) if stage and reduce_dtype else None
        trainer = tm.Trainer(
            model,
            make_optimizer(model),
            loss_fn,
            zero_stage=stage,
            distribution=distribution,
            precision=cfg["precision"],
            progress=False,
            callbacks=[Clock()],
        )
        optimizer, wrapped = trainer.optimizer, trainer.model

        def on_step(opt, *a):
            if phase["step"] < mem_steps:
                info["state_at_step"].append(count_trainmesh_state(wrapped, opt))

        optimizer.register_step_post_hook(on_step)
        info["wrapped"] = type(wrapped).__name__
        info["optimizer"] = type(optimizer).__name__
    else:
        import deepspeed

        from trainmesh.runtime.host_allocator import keep_freed_host_memory

        keep_freed_host_memory()  # the malloc settings tm.initialize gives trainmesh's side (see HOST_MALLOC)
        torch_dist.init_process_group("gloo")
        deepspeed.init_distributed(dist_backend="gloo")
        rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
        base = make_optimizer(model)
        ds_config = deepspeed_config(cfg, stage, ds_bucket_elements(model, stage))
        info["ds_config"] = ds_config
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=base, config=ds_config)
        info["wrapped"] = type(engine).__name__
        info["optimizer"] = type(ds_opt).__name__
        info["ds_overlap_comm_effective"] = bool(engine.zero_overlap_comm())
        info["ds_contiguous_gradients_effective"] = bool(engine.zero_contiguous_gradients())
        info["ds_communication_data_type"] = str(engine.communication_data_type)
        info["deepspeed_version"] = deepspeed.__version__

        def on_step(opt, *a):
            if phase["step"] < mem_steps:
                info["state_at_step"].append(count_deepspeed_state(engine, base))

        base.register_step_post_hook(on_step)

    def setup_done() -> None:
        gc.collect()
        info["live_after_setup"] = tracker.live
        info["hwm_reset"] = reset_hwm()
        info["rss_after_setup_kb"] = proc_status_kb("VmRSS")
        tracker.reset_peak()
        if mem_steps == 0:
            end_memory_phase()

    if system == "trainmesh":
        trainer.fit((x, y), epochs=1, batch_size=cfg["batch"], shuffle=False)
    else:
        setup_done()
        local = cfg["batch"] // world
        for k in range(total_steps):
            t0 = _barrier_time()
            c0 = time.process_time()
            start = k * cfg["batch"] + rank * local
            loss = loss_fn(engine(x[start : start + local]), y[start : start + local])
            engine.backward(loss)
            engine.step()  # includes zero_grad
            mean = loss.detach().float().clone()
            torch_dist.all_reduce(mean)  # the same per-step loss all-reduce the Trainer does (log_every_n_steps=1)
            cpu_times.append(time.process_time() - c0)
            step_times.append(_barrier_time() - t0)
            losses.append(mean.item() / world)
            phase["step"] += 1
            if phase["step"] == mem_steps:
                end_memory_phase()

    state = info["state_at_step"][-1] if info["state_at_step"] else {}
    result = {
        "rank": rank,
        "world": world,
        "variant": variant,
        "num_params": num_params,
        "peak_live_bytes": info.get("peak_live"),
        "live_after_setup_bytes": info.get("live_after_setup"),
        "live_end_of_memory_steps_bytes": info.get("live_end"),
        "rss_after_setup_kb": info.get("rss_after_setup_kb"),
        "vm_hwm_kb": info.get("vm_hwm_kb"),
        "hwm_reset": info.get("hwm_reset"),
        "model_state": state,
        "model_state_bytes": sum(v for k, v in state.items() if k != "other"),
        "step_times_s": step_times,
        "step_cpu_s": cpu_times,
        "losses": losses,
        "wrapped": info.get("wrapped"),
        "optimizer": info.get("optimizer"),
        "ds_config": info.get("ds_config"),
        "host_malloc": host_malloc_setting(),
        "deepspeed_version": info.get("deepspeed_version"),
        "ds_overlap_comm_effective": info.get("ds_overlap_comm_effective"),
        "ds_contiguous_gradients_effective": info.get("ds_contiguous_gradients_effective"),
        "ds_communication_data_type": info.get("ds_communication_data_type"),
    }
    gathered = [None] * world
    torch_dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(gathered, fh)
    torch_dist.barrier()
    torch_dist.destroy_process_group()
