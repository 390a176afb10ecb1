"""LoRA fine-tuning on 4 processes: adapters against full fine-tuning, and trainmesh ZeRO-3 against peft under DDP.

    python benchmarks/finetune.py [--quick] [--rounds R] [--steps S] [--warmup W] [--mem-steps M] [--mem-rounds K]
                                  [--sides a,b,...] [--precision auto|fp32|bf16-mixed] [--seed N] [--json PATH]

Defaults: 8 timing rounds x (1 warmup + 3 timed steps) per side, 2 fresh memory launches per side x 3 steps
(about 8 minutes on 2 cores); ``--quick``: 2 x (1 + 2), 1 launch x 2 steps, about a minute.

The model: a transformers Llama of 100.7M parameters built from a config (hidden 768, 12 layers, MLP 2048,
12 heads and 4 KV heads, vocabulary 16384, untied head; ``--quick``: hidden 128, 2 layers, vocabulary 2048),
initialised once from a seed and written by transformers' ``save_pretrained`` to a scratch directory: the
"pretrained checkpoint" every side starts from. The adapters: peft ``LoraConfig(r=16, lora_alpha=32,
lora_dropout=0)`` on q, k, v, o, gate, up and down projections (2.6M trainable parameters, 2.6%). AdamW
(lr 1e-4, no weight decay, torch's default kernels) over the trainable parameters on every side; 4 gloo
processes of one thread each; sequences of 128 tokens, one per process and step (``--quick``: 2 x 64).

Sides (``--sides``):

* ``tm-full``: full fine-tuning, ``tm.Trainer(model, AdamW, loss, zero_stage=3, weights=DIR)`` over a
  meta-built ``LlamaForCausalLM`` (each process reads only its shards' bytes);
* ``tm-lora``: the same with ``peft.get_peft_model(meta_model, LoraConfig(...))``;
* ``peft-ddp`` (the peer): ``AutoModelForCausalLM.from_pretrained(DIR)`` + ``get_peft_model`` wrapped in
  ``torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)`` (torch's other defaults:
  bucket_cap_mb 25, find_unused_parameters False: every trainable parameter gets a gradient), each process
  slicing its rows of the global batch, a four-line loop (forward, loss, backward, step, zero_grad);
* ``accelerate``: the same peft model through ``Accelerator(cpu=True)`` with the same DDP kwargs (optional:
  left out, said so, when accelerate is not importable);
* ``tm-lora-dp`` (diagnostic): ``tm-lora`` under ``zero_stage=0`` (DDP underneath), to separate what the
  ZeRO-3 layout costs from what the Trainer costs.
* ``tm-lora-regather`` (the same run's "before"): ``tm-lora`` with ``DataParallel(zero_stage=3,
  keep_frozen_gathered=False)``: the frozen base gathered again in backward, as before issue 47 (``tm-lora``
  keeps it gathered from forward to backward, ``_torch/frozen_units.py``).

``--memory-sides`` may add ``tm-full-notrim`` and ``tm-lora-notrim`` (the same launches with
``TRAINMESH_MALLOC_TRIM=0``: no ``malloc_trim`` between steps, ``runtime/memory_trim.py``) and
``tm-lora-regather``: figures ``lora_peak_vs_full_ft_without_trim`` and ``lora_regather_peak_vs_full_ft``;
``tm-full-upcast`` and ``tm-lora-upcast``: the loss before issue 47 (below), figures
``lora_peak_vs_full_ft_upcast_loss`` and ``lora_peak_live_vs_full_ft_upcast_loss``.

The loss, on every side (both trainmesh sides and the peers, so the same work everywhere): trainmesh's
``lm_cross_entropy`` on whole logits, which computes the fp32 mean a block of rows at a time and writes the
gradient in the logits' dtype (``trainmesh/chunked_cross_entropy.py``). Until issue 47 it was
``F.cross_entropy(logits.float())``, which under bf16-mixed holds three fp32 buffers of the logits' size at its
backward (24 MiB a process at 128 tokens x 16k vocabulary): the same values, a lower peak on every side.

Precision: ``--precision auto`` (the default) takes ``fastest_precision("cpu")`` as the demo does;
bf16-mixed means autocast on both sides (the peer: ``torch.autocast("cpu", torch.bfloat16)`` around its
forward, accelerate ``mixed_precision="bf16"``), fp32 master weights, fp32 gradient reduction.

Measurements, each in the same run:

* memory: each of ``tm-full``, ``tm-lora``, ``peft-ddp`` in fresh processes: the peak RSS growth per process
  (``trainmesh.testing.rss.PeakRSSGrowth``: ``VmHWM`` reset before the model is built, so building, loading
  and M steps count), the worst process, the median over launches; beside it, the most tensor bytes alive at
  once while building and during the steps (``trainmesh.testing.memory.LiveTensorBytes``, which sees storages
  made through the dispatcher, not gloo's own buffers), and the bytes glibc malloc holds free at the end
  (``mallinfo2``): RSS = live tensors + what the allocator keeps + gloo's and the interpreter's own;
* gradient bytes: in the same fresh processes, one more step under trainmesh's dispatcher-level collective
  counter (``trainmesh.planner.collectives.CollectiveCounter``, the planner's definition: the full buffer of
  each c10d call; on gloo FSDP2's reduce-scatter is carried by an all-reduce, ``comm/allreduce_scatter.py``,
  and filed as the reduce-scatter it is). The gradient collectives of ZeRO-3 are its reduce-scatters; of DDP its
  bucket all-reduces (calls above 1 KiB: the Trainer's loss and flag all-reduces are a few bytes); a mostly frozen
  model's adapters under ZeRO-3 are replicated and all-reduced in one flat buffer, counted with the reduce-scatters;
* step time: every timed side built in the same 4 processes, rounds interleaved (each side W warmup + S timed
  steps a round, the order rotating and reversing, ``trainer_overhead.round_order``); a Trainer step is the time
  between two ``on_train_batch_end`` callbacks inside ``fit`` (batch fetch, forward/backward, reduction, the
  loss check, step, zero_grad, the loss all-reduce); a step counts as long as its slowest process. Ratios are
  the median of per-round ratios of median steps;
* parity (4 fresh processes of its own, after the timing: nothing left by the timed sides): a small Llama (hidden 64, 2 layers) with LoRA r=16
  (``init_lora_weights=False``: lora_B random, so every adapter moves from the first step), fp32, 10 steps of a
  global batch of 8, under ``ModelParallel`` with ``LayoutMap.auto`` on a (2, 2) ``["data", "model"]`` mesh and
  under ZeRO-3, against a plain one-process peft loop over the same batches: the largest adapter difference.
  The figure's optimizer is SGD (lr 0.5, momentum 0.9), as ``tests/multiprocess/lora_cases.py``'s; the same runs
  with AdamW (lr 1e-2) are reported beside it, with AdamW's own noise on one process (the same batches as 4
  micro-batches against 1), which alone is ~8e-5 after 10 steps: see ``parity_optimizer``.

Same work: the first step's global loss of every side must agree (fp32: 1e-5 relative; bf16-mixed 2e-2), else
INVALID and exit 1: LoRA starts with lora_B = 0, so at the first step every side computes the base model's loss.

Figures (``--json``): ``lora_grad_bytes_vs_full``, ``lora_peak_vs_full_ft`` (RSS), ``lora_step_vs_full_ft``,
``lora_step_vs_peft_ddp``, ``lora_parity_max_abs_diff``; for context (no goal): ``lora_peak_live_vs_full_ft``,
``lora_steps_peak_live_vs_full_ft``, ``lora_peak_vs_peft_ddp``, ``lora_step_vs_accelerate``,
``lora_dp_step_vs_peft_ddp``, ``lora_gather_bytes_vs_full``, ``lora_parity_adamw_max_abs_diff``,
``adamw_microbatch_noise_1proc``. ``--quick`` is a smoke run for tests (the small Llama, no memory launch for the
peer): too few steps, and too small a model, to judge a goal.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

from trainer_overhead import round_order  # rotating, reversing rounds, as the other step-time benchmarks

from trainmesh.losses import lm_cross_entropy

WORLD = 4
SIZES = {
    "full": dict(hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, vocab=16384, seq=128, rows=1),
    # --size medium (22M parameters): the full model's shape at half the width and depth, for a loaded machine
    "medium": dict(hidden=384, layers=6, intermediate=1024, heads=6, kv_heads=2, vocab=16384, seq=128, rows=1),
    "quick": dict(hidden=128, layers=2, intermediate=384, heads=4, kv_heads=2, vocab=2048, seq=64, rows=2),
}
PARITY_SIZE = dict(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, vocab=128, seq=16, rows=2)
PARITY_STEPS, PARITY_LR = 10, 1e-2
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0)
LR = 1e-4
DDP_KWARGS = {"gradient_as_bucket_view": True}
ALL_SIDES = ("tm-full", "tm-lora", "peft-ddp", "accelerate", "tm-lora-dp", "tm-lora-regather")
MEMORY_SIDES = ("tm-full", "tm-lora", "peft-ddp")
# --memory-sides may add: the same runs without the allocator trim (memory_trim.py), and LoRA with the frozen
# base gathered again in backward (keep_frozen_gathered=False, the behaviour before issue 47)
EXTRA_MEMORY_SIDES = (
    "tm-full-notrim",
    "tm-lora-notrim",
    "tm-lora-regather",
    # the loss before issue 47's chunked one: F.cross_entropy(logits.float()), three fp32 logits-size buffers
    "tm-full-upcast",
    "tm-lora-upcast",
)
UPCAST_LOSS = False  # set in the fresh processes of an "-upcast" memory side
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16-mixed": 2e-2}
SMALL_COLLECTIVE = 1024  # bytes: control all-reduces (loss, flags) are below, gradient buckets far above
GOALS = {  # figure -> (text, test)
    "lora_grad_bytes_vs_full": ("<= 0.05", lambda v: v <= 0.05),
    "lora_peak_vs_full_ft": ("<= 0.5", lambda v: v <= 0.5),
    "lora_step_vs_full_ft": ("<= 0.7", lambda v: v <= 0.7),
    # issue 47: ZeRO-3 LoRA within 1.15x peft under DDP (it shards the base), DataParallel LoRA at most 1.0x
    "lora_step_vs_peft_ddp": ("<= 1.15", lambda v: v <= 1.15),
    "lora_dp_step_vs_peft_ddp": ("<= 1.0", lambda v: v <= 1.0),
    "lora_parity_max_abs_diff": ("<= 1e-5", lambda v: v <= 1e-5),
}
PEER_SETTINGS = {
    "peft": "get_peft_model(from_pretrained(DIR), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="
    "q,k,v,o,gate,up,down, task_type=CAUSAL_LM)), peft's default init (lora_B zero)",
    "DDP": "DistributedDataParallel(model, gradient_as_bucket_view=True); torch's defaults otherwise "
    "(bucket_cap_mb 25, find_unused_parameters False, broadcast_buffers True); frozen parameters are in no "
    "bucket",
    "optimizer": "torch.optim.AdamW(trainable parameters, lr=1e-4, weight_decay=0), torch's default kernels, "
    "zero_grad(set_to_none=True)",
    "accelerate": "Accelerator(cpu=True, mixed_precision as the run, kwargs_handlers=[DistributedDataParallelKwargs("
    "gradient_as_bucket_view=True)]); accelerator.backward",
}
TRAINMESH_SETTINGS = (
    "tm.Trainer(meta-built model, AdamW factory, loss, zero_stage=3, weights=DIR, precision=<run's>, "
    "progress=False); every other option its default (log_every_n_steps=1, nonfinite_loss='skip')"
)


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


def _global_mean(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# --------------------------------------------------------------------------- workers
def _malloc_free_bytes() -> int | None:
    """Bytes glibc malloc holds free in its arenas (``mallinfo2().fordblks``), or None off glibc."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        return int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return None


def _peak_census_class():
    """A ``LiveTensorBytes`` that also keeps, at its peak, the size of every live storage and the operator that
    reached it: what makes up a side's peak (gathered units, saved activations, loss buffers, optimizer state),
    read by size (a census, not names: storages carry none)."""
    from trainmesh.testing.memory import LiveTensorBytes

    class PeakCensus(LiveTensorBytes):
        census: tuple[str, list[int], list[tuple[int, str]]] = ("", [], [])
        op = "outside an operator"

        def track(self, storage):
            before, key = self.peak, storage._cdata
            counted = self._sizes.get(key)
            super().track(storage)
            size = self._sizes.get(key, 0)
            if size >= 2**20 and size != counted:  # which operator made (or resized) each large storage
                self._made = getattr(self, "_made", {})
                self._made[key] = self.op
            if self.live > before:  # a new peak: a copy of the sizes (a few hundred), sorted once at the end
                self.census = (self.op, list(self._sizes.values()), self._large())

        def _large(self) -> list[tuple[int, str]]:
            made = getattr(self, "_made", {})
            return [(n, made.get(k, "?")) for k, n in self._sizes.items() if n >= 2**20]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def reset_peak(self):
            super().reset_peak()
            self.census = (self.op, list(self._sizes.values()), self._large())

        def summary(self, top: int = 8) -> dict:
            """The peak's operator, its largest storage sizes (MiB x count), the rest, and the storages of at least
            1 MiB with the operator that made them (a storage FSDP2 resizes outside the dispatcher shows the last
            operator before it)."""
            op, sizes, large = self.census
            counts: dict[float, int] = {}
            for size in sorted(sizes, reverse=True):
                if size >= 2**18:
                    counts[round(size / 2**20, 2)] = counts.get(round(size / 2**20, 2), 0) + 1
            largest = sorted(counts.items(), reverse=True)[:top]
            shown = sum(mib * 2**20 * n for mib, n in largest)
            made = sorted(((round(n / 2**20, 2), by) for n, by in large), reverse=True)
            return {"op": op, "largest_mib_x_count": largest, "rest_bytes": sum(sizes) - shown, "made_by": made}

    return PeakCensus


def _rss_file_bytes() -> int:
    """Resident pages mapped from files (``RssFile``: code of the libraries a step first runs, e.g. libtorch's
    kernels): a fixed cost every side pays, in its RSS growth, that no tensor explains."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_worker(cfg: dict, side: str) -> dict:
    """One side in fresh processes: peak RSS growth and live tensor bytes over build + M steps, then the
    bytes of one more step's collectives, counted at the dispatcher."""
    import peft  # noqa: F401 - imports before the baseline: they are no side's cost
    import transformers  # noqa: F401

    import trainmesh  # noqa: F401
    from trainmesh.planner.collectives import CollectiveCounter, CollectiveLog
    from trainmesh.testing.rss import PeakRSSGrowth, current_rss_bytes, peak_rss_bytes

    class CallLog(CollectiveLog):
        def add(self, axis, kind, nbytes, count=1):
            super().add(axis, kind, nbytes, count)
            self.calls = getattr(self, "calls", []) + [(kind, int(nbytes))]

    if side.endswith("-notrim"):  # read by memory_trim at each step; these are fresh processes
        os.environ["TRAINMESH_MALLOC_TRIM"] = "0"
        side = side.removesuffix("-notrim")
    if side.endswith("-upcast"):
        global UPCAST_LOSS
        UPCAST_LOSS = True
        side = side.removesuffix("-upcast")
    steps = cfg["mem_steps"]
    x, y = token_data(cfg["size"], steps + 1, cfg["seed"] + 1)
    batch = cfg["size"]["rows"] * WORLD
    out = {"rss_start": current_rss_bytes(), "rss_file_start": _rss_file_bytes()}
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PeakRSSGrowth() as growth, _peak_census_class()("cpu") as live:
            runner = build_side(cfg, side)
            out.update(
                live_after_build=live.live, live_peak_build=live.peak, rss_growth_build=peak_rss_bytes() - growth.start
            )
            live.reset_peak()
            runner.run(x[: steps * batch], y[: steps * batch])
        out.update(
            rss_growth=growth.bytes,
            live_peak=max(live.peak, out["live_peak_build"]),
            live_peak_steps=live.peak,
            malloc_free=_malloc_free_bytes(),
            rss_file_growth=_rss_file_bytes() - out["rss_file_start"],
            peak_census=live.summary(),
        )
        log = CallLog()
        with CollectiveCounter({}, log=log):
            runner.run(x[steps * batch :], y[steps * batch :])
    calls = getattr(log, "calls", [])
    out["collectives"] = {kind: sum(n for k, n in calls if k == kind) for kind in {k for k, _ in calls}}
    # ZeRO-3's gradients: its reduce-scatters, and the one flat all-reduce of a mostly frozen model's replicated
    # adapters (``_torch/replicated_grads.py``); DDP's: its bucket all-reduces
    grad_kinds = (
        ("reduce_scatter", "all_reduce") if side in ("tm-full", "tm-lora", "tm-lora-regather") else ("all_reduce",)
    )
    out["grad_bytes"] = sum(n for k, n in calls if k in grad_kinds and n > SMALL_COLLECTIVE)
    out["gather_bytes"] = sum(n for k, n in calls if k == "all_gather")
    out["vmhwm"] = peak_rss_bytes()
    return out


def timing_worker(cfg: dict) -> dict:
    """Every timed side in these processes, rounds interleaved."""
    import torch.distributed as dist

    sides, captured = {}, io.StringIO()
    with contextlib.redirect_stdout(captured), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for side in cfg["sides"]:
            sides[side] = build_side(cfg, side)
    per_phase = cfg["warmup"] + cfg["steps"]
    batch = cfg["size"]["rows"] * WORLD
    x, y = token_data(cfg["size"], cfg["rounds"] * per_phase, cfg["seed"] + 1)
    times = {side: [] for side in sides}
    losses = {side: [] for side in sides}
    orders = []
    for r in range(cfg["rounds"]):
        order = round_order(list(sides), r)
        orders.append(order)
        rows = slice(r * per_phase * batch, (r + 1) * per_phase * batch)  # every side sees the same batches
        for side in order:
            dist.barrier()  # every process starts the phase together
            with contextlib.redirect_stdout(captured):
                step_times, step_losses = sides[side].run(x[rows], y[rows])
            times[side].append(step_times[cfg["warmup"] :])  # a phase's first step carries fit's own set-up
            losses[side].append(step_losses)
    for side, runner in sides.items():
        if isinstance(runner, LoopSide):  # local losses -> global means (the Trainer reports global ones)
            losses[side] = [_global_mean(values) for values in losses[side]]
    threads = torch.get_num_threads()
    del sides
    return {
        "times": times,
        "losses": losses,
        "orders": orders,
        "threads": threads,
        "trainer_output": captured.getvalue()[-2000:],
    }


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


# --------------------------------------------------------------------------- driver
def _median(values):
    return statistics.median(values) if values else float("nan")


def summarize(cfg: dict, memory: dict, timing: list[dict], parity: dict, counts: dict) -> dict:
    from trainmesh.testing.stats import median_ci95

    report = {"config": {k: v for k, v in cfg.items() if k != "base_dir"}, "counts": counts}
    # memory: the worst process of each launch, the median over launches
    mem = {}
    for side, launches in memory.items():
        worst = lambda key: _median([max(r[key] for r in ranks) for ranks in launches])  # noqa: E731
        mem[side] = {
            "rss_growth": worst("rss_growth"),
            "rss_growth_build": worst("rss_growth_build"),
            "live_peak": worst("live_peak"),
            "live_peak_build": worst("live_peak_build"),
            "live_peak_steps": worst("live_peak_steps"),
            "live_after_build": worst("live_after_build"),
            "vmhwm": worst("vmhwm"),
            "malloc_free": worst("malloc_free") if launches[0][0]["malloc_free"] is not None else None,
            "rss_file_growth": worst("rss_file_growth"),
            "peak_census_rank0": launches[0][0]["peak_census"],
            "grad_bytes": _median([ranks[0]["grad_bytes"] for ranks in launches]),
            "gather_bytes": _median([ranks[0]["gather_bytes"] for ranks in launches]),
            "collectives_rank0": launches[0][0]["collectives"],
        }
    report["memory"] = mem
    # step times: a step is as slow as its slowest process
    sides = cfg["sides"]
    steps = {
        s: [[max(ts) for ts in zip(*(res["times"][s][r] for res in timing))] for r in range(cfg["rounds"])]
        for s in sides
    }
    med = {s: _median([t for rnd in steps[s] for t in rnd]) for s in sides}
    report["step_s"] = {
        s: {
            "median": med[s],
            "per_round_median": [_median(rnd) for rnd in steps[s]],
            "ci95_of_median": median_ci95([t for rnd in steps[s] for t in rnd]),
        }
        for s in sides
    }
    report["orders"] = timing[0]["orders"]

    def ratio(a: str, b: str) -> dict | None:
        if a not in sides or b not in sides:
            return None
        rounds = [_median(x) / _median(y) for x, y in zip(steps[a], steps[b])]
        return {
            "ratio": _median(rounds),
            "per_round": rounds,
            "pooled": med[a] / med[b],
            "ci95": median_ci95(rounds) if len(rounds) > 1 else None,
        }

    report["step_ratios"] = {
        name: ratio(a, b)
        for name, (a, b) in {
            "lora_step_vs_full_ft": ("tm-lora", "tm-full"),
            "lora_step_vs_peft_ddp": ("tm-lora", "peft-ddp"),
            "lora_step_vs_accelerate": ("tm-lora", "accelerate"),
            "lora_dp_step_vs_peft_ddp": ("tm-lora-dp", "peft-ddp"),
            "lora_regather_step_vs_peft_ddp": ("tm-lora-regather", "peft-ddp"),
            "lora_step_vs_regather": ("tm-lora", "tm-lora-regather"),
            "accelerate_step_vs_peft_ddp": ("accelerate", "peft-ddp"),
        }.items()
        if ratio(a, b) is not None
    }
    # same work: every side's first global loss (the same base model, the same rows, lora_B = 0)
    first = {s: timing[0]["losses"][s][0][0] for s in sides}
    reference = first["tm-full"] if "tm-full" in first else next(iter(first.values()))
    tolerance = LOSS_TOLERANCE[cfg["precision"]]
    report["first_losses"] = first
    report["same_work"] = all(abs(v - reference) <= tolerance * abs(reference) for v in first.values())
    report["final_losses"] = {s: timing[0]["losses"][s][-1][-1] for s in sides}
    report["parity"] = parity
    figures = {}
    if "tm-lora" in mem and "tm-full" in mem:
        figures["lora_grad_bytes_vs_full"] = mem["tm-lora"]["grad_bytes"] / mem["tm-full"]["grad_bytes"]
        figures["lora_peak_vs_full_ft"] = mem["tm-lora"]["rss_growth"] / mem["tm-full"]["rss_growth"]
    for name in ("lora_step_vs_full_ft", "lora_step_vs_peft_ddp"):
        if name in report["step_ratios"]:
            figures[name] = report["step_ratios"][name]["ratio"]
    figures["lora_parity_max_abs_diff"] = max(parity["max_abs_diff"].values())
    figures["lora_parity_adamw_max_abs_diff"] = max(parity["adamw_max_abs_diff"].values())
    figures["adamw_microbatch_noise_1proc"] = parity["adamw_microbatch_noise_1proc"]
    if "tm-lora" in mem and "tm-full" in mem:
        figures["lora_peak_live_vs_full_ft"] = mem["tm-lora"]["live_peak"] / mem["tm-full"]["live_peak"]
        figures["lora_steps_peak_live_vs_full_ft"] = (
            mem["tm-lora"]["live_peak_steps"] / mem["tm-full"]["live_peak_steps"]
        )
        figures["lora_gather_bytes_vs_full"] = mem["tm-lora"]["gather_bytes"] / mem["tm-full"]["gather_bytes"]
    if "tm-lora" in mem and "peft-ddp" in mem:
        figures["lora_peak_vs_peft_ddp"] = mem["tm-lora"]["rss_growth"] / mem["peft-ddp"]["rss_growth"]
    if "tm-lora-notrim" in mem and "tm-full-notrim" in mem:
        figures["lora_peak_vs_full_ft_without_trim"] = (
            mem["tm-lora-notrim"]["rss_growth"] / mem["tm-full-notrim"]["rss_growth"]
        )
    if "tm-lora-upcast" in mem and "tm-full-upcast" in mem:
        figures["lora_peak_vs_full_ft_upcast_loss"] = (
            mem["tm-lora-upcast"]["rss_growth"] / mem["tm-full-upcast"]["rss_growth"]
        )
        figures["lora_peak_live_vs_full_ft_upcast_loss"] = (
            mem["tm-lora-upcast"]["live_peak"] / mem["tm-full-upcast"]["live_peak"]
        )
    if "tm-lora-regather" in mem and "tm-full" in mem:
        figures["lora_regather_peak_vs_full_ft"] = mem["tm-lora-regather"]["rss_growth"] / mem["tm-full"]["rss_growth"]
    for name in (
        "lora_step_vs_accelerate",
        "lora_dp_step_vs_peft_ddp",
        "lora_regather_step_vs_peft_ddp",
        "lora_step_vs_regather",
    ):
        if name in report["step_ratios"]:
            figures[name] = report["step_ratios"][name]["ratio"]
    report["figures"] = figures
    report["valid"] = report["same_work"] and parity["adapters_moved"] > 1e-3 and parity["frozen_unchanged"]
    return report


def print_report(report: dict) -> None:
    cfg, mb = report["config"], 2**20
    size, counts = cfg["size"], report["counts"]
    print(
        f"Llama {counts['params'] / 1e6:.1f}M parameters (hidden {size['hidden']}, {size['layers']} layers, "
        f"vocabulary {size['vocab']}), LoRA r={LORA['r']} on {','.join(TARGET_MODULES)}: "
        f"{counts['trainable'] / 1e6:.2f}M trainable ({counts['trainable'] / counts['params']:.1%}); "
        f"{WORLD} gloo processes x 1 thread; "
        f"{size['rows']} x {size['seq']} tokens per process and step; precision {cfg['precision']} "
        f"({cfg['precision_why']}); {cfg['rounds']} rounds x ({cfg['warmup']} warmup + {cfg['steps']} timed steps) "
        f"per side; memory: {cfg['mem_rounds']} fresh launch(es) per side x {cfg['mem_steps']} steps"
    )
    print(f"trainmesh: {TRAINMESH_SETTINGS}")
    for name, text in PEER_SETTINGS.items():
        print(f"peer {name}: {text}")
    if cfg.get("skipped"):
        print("not run: " + "; ".join(cfg["skipped"]))
    cols = ("RSS+ build", "RSS+ peak", "live build", "live steps", "malloc free", "grad/step", "gather/step")
    header = f"{'side':<12}{'step s':>8}{'95% CI':>11}" + "".join(f"{c:>12}" for c in cols) + f"{'1st loss':>10}"
    print(header + "\n" + "-" * len(header))
    for side in cfg["sides"]:
        st, m = report["step_s"][side], report["memory"].get(side)
        lo, hi = st["ci95_of_median"]
        keys = (
            "rss_growth_build",
            "rss_growth",
            "live_peak_build",
            "live_peak_steps",
            "malloc_free",
            "grad_bytes",
            "gather_bytes",
        )
        mem_cols = "".join(f"{(m[k] or 0) / mb:>12.1f}" if m else f"{'-':>12}" for k in keys)
        interval = f"{lo:.2f}-{hi:.2f}"
        print(f"{side:<12}{st['median']:>8.3f}{interval:>11}{mem_cols}{report['first_losses'][side]:>10.5f}")
    print(
        "MB (2^20 bytes), the worst process: RSS+ = peak RSS growth from before the model is built, to the end of "
        "building / of the memory steps; live = most tensor bytes alive at once while building / during the steps; "
        "malloc free = what glibc malloc holds free at the end"
    )
    print(
        "grad / gather MB: one process's gradient collectives (ZeRO-3 reduce-scatters, DDP all-reduces) and "
        "parameter all-gathers per step, full buffers, counted at the dispatcher"
    )
    for side, m in report["memory"].items():
        census = m["peak_census_rank0"]
        largest = ", ".join(f"{mib:g}x{n}" for mib, n in census["largest_mib_x_count"])
        print(
            f"{side} step peak (rank 0, first launch) at {census['op']}: largest storages MiB x count {largest}; "
            f"the rest {census['rest_bytes'] / mb:.1f} MiB; file-backed RSS growth (library code) "
            f"{m['rss_file_growth'] / mb:.1f} MiB; made by: "
            + ", ".join(f"{mib:g} {by}" for mib, by in census.get("made_by", [])[:10])
        )
    p = report["parity"]
    print(
        f"parity ({PARITY_STEPS} steps of SGD lr 0.5 momentum 0.9, fp32, adapters vs one process): "
        + ", ".join(f"{k} {v:.3g}" for k, v in p["max_abs_diff"].items())
        + "; with AdamW (lr 1e-2): "
        + ", ".join(f"{k} {v:.3g}" for k, v in p["adamw_max_abs_diff"].items())
        + f" against AdamW's own noise on one process (4 micro-batches vs 1) {p['adamw_microbatch_noise_1proc']:.3g}"
        + f"; adapters moved {p['adapters_moved']:.3g}; frozen base unchanged: {p['frozen_unchanged']}; "
        f"TP sharded parameters {p['tp_sharded_params']}"
    )
    print()
    quick = " (--quick: smoke run, too few steps to judge)" if cfg["quick"] else ""
    print(f"{'figure':<30}{'value':>10}  {'goal':<9}{'verdict':<9}per-round range")
    for name, value in report["figures"].items():
        goal = GOALS.get(name)
        verdict = ("met" if goal[1](value) else "NOT MET") if goal else "-"
        rounds = report["step_ratios"].get(name, {}).get("per_round")
        spread = f"{min(rounds):.3f}-{max(rounds):.3f}" if rounds else ""
        print(f"{name:<30}{value:>10.4g}  {goal[0] if goal else '-':<9}{verdict:<9}{spread}")
    if quick:
        print(quick.strip())
    if not report["same_work"]:
        print(
            f"INVALID: first-step losses differ beyond {LOSS_TOLERANCE[cfg['precision']]:g} relative: "
            f"{report['first_losses']}"
        )
    elif not report["valid"]:
        print("INVALID: the parity run did not train the adapters or changed the frozen base")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small Llama, few steps: about a minute")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 8; --quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per side per round (default 3; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side per round (>= 1)")
    parser.add_argument("--mem-steps", type=int, help="steps in each memory launch (default 3; --quick 2)")
    parser.add_argument("--mem-rounds", type=int, help="fresh launches per side for memory (default 2; --quick 1)")
    parser.add_argument("--sides", default=",".join(ALL_SIDES), help=f"timed sides, of {','.join(ALL_SIDES)}")
    parser.add_argument("--size", choices=tuple(SIZES), help="the model (default full; --quick: quick)")
    parser.add_argument(
        "--memory-sides",
        help=f"memory launches, of {','.join(MEMORY_SIDES + EXTRA_MEMORY_SIDES)} (default: {','.join(MEMORY_SIDES)}; "
        "--quick: the first two)",
    )
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16-mixed"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the report (with a top-level 'figures') here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    sides = [s for s in args.sides.split(",") if s]
    bad_memory = set((args.memory_sides or "").split(",")) - set(MEMORY_SIDES + EXTRA_MEMORY_SIDES) - {""}
    if set(sides) - set(ALL_SIDES) or args.warmup < 1 or bad_memory:
        parser.error(f"--sides must be of {ALL_SIDES}; --warmup >= 1 (a phase's first step carries fit's set-up)")
    skipped = []
    if "accelerate" in sides:
        try:
            import accelerate  # noqa: F401
        except ImportError as error:
            sides.remove("accelerate")
            skipped.append(f"accelerate ({error})")
    if args.precision == "auto":
        from trainmesh.trainer.precision import fastest_precision

        precision, why = fastest_precision("cpu")
    else:
        precision, why = args.precision, "--precision"
    cfg = {
        "quick": args.quick,
        "size": SIZES[args.size or ("quick" if args.quick else "full")],
        "precision": precision,
        "precision_why": why,
        "rounds": args.rounds or (2 if args.quick else 8),
        "steps": args.steps or (2 if args.quick else 3),
        "warmup": args.warmup,
        "mem_steps": args.mem_steps or (2 if args.quick else 3),
        "mem_rounds": args.mem_rounds or (1 if args.quick else 2),
        "sides": sides,
        "seed": args.seed,
        "skipped": skipped,
    }
    import peft
    import transformers

    from trainmesh.testing import run_distributed

    started = time.time()
    load_before = os.getloadavg()[0]
    scratch = tempfile.mkdtemp(prefix="finetune-")
    try:
        cfg["base_dir"] = os.path.join(scratch, "base")
        torch.manual_seed(args.seed)
        base = transformers.LlamaForCausalLM(llama_config(cfg["size"]))
        base.save_pretrained(cfg["base_dir"])
        counts = {"params": sum(p.numel() for p in base.parameters())}
        counts["trainable"] = sum(
            p.numel() for p in peft.get_peft_model(base, lora_config()).parameters() if p.requires_grad
        )
        del base
        # --quick: the two launches the figures need (the peer's peak is context); a launch costs ~25 s here
        memory_sides = list(MEMORY_SIDES[:2] if args.quick else MEMORY_SIDES)
        if args.memory_sides:
            memory_sides = [s for s in args.memory_sides.split(",") if s]
        memory = {side: [] for side in memory_sides}
        for r in range(cfg["mem_rounds"]):
            for side in round_order(memory_sides, r):
                t = time.time()
                memory[side].append(
                    run_distributed(
                        memory_worker, world_size=WORLD, args=(cfg, side), timeout=1800, collective_timeout=900
                    )
                )
                print(f"  memory {side}: {time.time() - t:.0f} s", flush=True)
        t = time.time()
        timing = run_distributed(timing_worker, world_size=WORLD, args=(cfg,), timeout=3600, collective_timeout=900)
        print(f"  timing: {time.time() - t:.0f} s", flush=True)
        t = time.time()
        parity = parity_summary(run_distributed(parity_run, world_size=WORLD, timeout=1800, collective_timeout=900)[0])
        print(f"  parity: {time.time() - t:.0f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = summarize(cfg, memory, timing, parity, counts)
    report.update(
        seconds=time.time() - started,
        load_avg_1min={"before": load_before, "after": os.getloadavg()[0]},
        versions={"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        raw={"memory": memory, "timing_times": [r["times"] for r in timing], "timing_losses": timing[0]["losses"]},
    )
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0 if report["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
