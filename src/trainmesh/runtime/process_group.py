"""Start (once) and query the job's default torch.distributed process group.

A single process still gets a real process group (gloo over an in-memory ``HashStore``),
so DTensor, DeviceMesh and DDP run unchanged on 1 process and on N; no socket is opened.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import os
import threading
from typing import Sequence

import torch
import torch.distributed as dist

from .cluster_env import ClusterEnv, detect_cluster_env
from .host_allocator import keep_freed_host_memory

DEFAULT_TIMEOUT_S = 300.0

_lock = threading.Lock()
_state: dict = {"cluster": None, "timeout": None, "owned": False, "exit_hook": False}
_on_shutdown: list = []


def on_shutdown(callback) -> None:
    """Run ``callback()`` when the process group goes away (e.g. to drop cached sub-meshes)."""
    if callback not in _on_shutdown:
        _on_shutdown.append(callback)


def _resolve_timeout(timeout: float | _dt.timedelta | None) -> _dt.timedelta:
    if isinstance(timeout, _dt.timedelta):
        seconds = timeout.total_seconds()
    elif timeout is not None:
        seconds = float(timeout)
    else:
        raw = os.environ.get("TRAINMESH_TIMEOUT_S")
        try:
            seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"TRAINMESH_TIMEOUT_S must be a number of seconds. Received: {raw!r}") from None
    if not seconds > 0:
        raise ValueError(f"The collective timeout must be positive. Received: timeout={timeout!r}")
    return _dt.timedelta(seconds=seconds)


def _resolve_backend(backend: str | None) -> str:
    backend = backend or os.environ.get("TRAINMESH_BACKEND") or None
    if backend is None:
        # NCCL for the GPU; gloo keeps CPU tensors (object collectives, metadata) working too.
        return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(f"backend='nccl' needs CUDA, and torch sees no CUDA device. Received: backend={backend!r}")
    return backend


def initialize(
    job_addresses: str | Sequence[str] | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    backend: str | None = None,
    timeout: float | _dt.timedelta | None = None,
) -> ClusterEnv:
    """Join the job (Keras ``keras.distribution.initialize`` signature). Idempotent.

    ``job_addresses`` is ``"host:port,host:port"`` or a list; its first entry is the
    coordinator. Explicit arguments win over ``TRAINMESH_*``/torchrun variables, which win
    over ``TF_CONFIG``, which wins over Slurm. With none of these, one process, no network.
    ``timeout`` (seconds; default ``TRAINMESH_TIMEOUT_S`` or 300) bounds every collective.

    >>> import trainmesh as tm
    >>> tm.initialize().world_size   # doctest: +SKIP
    1
    """
    with _lock:
        # Validate first: a contradiction must surface before any connection attempt.
        cluster = detect_cluster_env(job_addresses, num_processes, process_id)
        explicit = job_addresses is not None or num_processes is not None or process_id is not None
        if dist.is_available() and dist.is_initialized():
            current = _state["cluster"] or _adopt_existing_group()
            if explicit and (cluster.world_size, cluster.rank) != (current.world_size, current.rank):
                raise ValueError(
                    "trainmesh is already initialized as rank "
                    f"{current.rank} of {current.world_size}; initialize() was called again with "
                    f"rank {cluster.rank} of {cluster.world_size}. Call shutdown() first."
                )
            _tune_host_allocator()
            return current
        td = _resolve_timeout(timeout)
        chosen_backend = _resolve_backend(backend)
        if torch.cuda.is_available():
            _check_gpu_per_process(chosen_backend, cluster)
            torch.cuda.set_device(cluster.local_rank % torch.cuda.device_count())
        if cluster.world_size == 1:
            dist.init_process_group(chosen_backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
        else:
            elastic = cluster.source == "torchrun" and "TORCHELASTIC_RUN_ID" in os.environ
            if elastic:
                dist.init_process_group(
                    chosen_backend,
                    store=_elastic_store(cluster, td),
                    rank=cluster.rank,
                    world_size=cluster.world_size,
                    timeout=td,
                )
            else:
                dist.init_process_group(
                    chosen_backend,
                    init_method=cluster.init_method,
                    rank=cluster.rank,
                    world_size=cluster.world_size,
                    timeout=td,
                )
        _state.update(cluster=cluster, timeout=td, owned=True)
        _tune_host_allocator()
        if not _state.get("exit_hook"):  # once per process: initialize() may run again after shutdown()
            atexit.register(_release_at_exit)
            _state["exit_hook"] = True
        return cluster


def _tune_host_allocator() -> None:
    # A CPU run (a started group adopted too): reuse freed tensor memory instead of faulting in fresh pages.
    if not torch.cuda.is_available():
        keep_freed_host_memory()


def _check_gpu_per_process(backend: str, cluster: ClusterEnv) -> None:
    """NCCL drives one GPU per process; with more processes on a node than GPUs, two would share
    one and NCCL would fail inside the first collective ("Duplicate GPU detected"), on every rank."""
    gpus = torch.cuda.device_count()
    if "nccl" in backend and cluster.local_world_size > gpus:
        raise ValueError(
            f"{cluster.local_world_size} processes on this node share {gpus} GPU(s), and NCCL needs a GPU per "
            f"process: launch {gpus} per node (trainmesh run -n {gpus}, torchrun --nproc-per-node {gpus}), or "
            f"hide the GPUs (CUDA_VISIBLE_DEVICES='') to train on CPUs with gloo. Received: "
            f"local_world_size={cluster.local_world_size}, backend={backend!r}"
        )


def _elastic_store(cluster: ClusterEnv, timeout: _dt.timedelta):
    """torchrun's store (its ``env://`` rendezvous), with keys under this restart's own prefix.

    After an elastic restart the store can still hold the previous round's keys; without a
    prefix a fresh worker may read a dead peer's address and fail in gloo's connectFullMesh
    ("Connection refused") -- seen in the SIGKILL restart test, depending on timing.
    """
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", cluster.rank, cluster.world_size, timeout=timeout))
    # The restart count is each node's own: a node that replaces a lost host starts at 0 while
    # the survivors count on. Where the agents do not share their store with the workers
    # (`trainmesh run` on several nodes), every round's store is new, so no prefix is needed.
    unshared = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
    attempt = "new_store" if unshared else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"trainmesh/restart_{attempt}", store)


def _adopt_existing_group() -> ClusterEnv:
    """Someone (a user, a test harness) started the group already: describe it, don't replace it."""
    env = detect_cluster_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    if (env.rank, env.world_size) != (rank, world):
        env = ClusterEnv(rank, world, rank, world, 0, env.master_addr, env.master_port, "existing")
    _state.update(cluster=env, timeout=_state["timeout"] or _resolve_timeout(None), owned=False)
    return env


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def cluster_env() -> ClusterEnv:
    """The running job's :class:`ClusterEnv` (detected from the environment if not initialized)."""
    if is_initialized():
        return _state["cluster"] or _adopt_existing_group()
    return detect_cluster_env()


def rank() -> int:
    return dist.get_rank() if is_initialized() else cluster_env().rank


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else cluster_env().world_size


def local_rank() -> int:
    return cluster_env().local_rank


def is_main_process() -> bool:
    return rank() == 0


def backend() -> str | None:
    return dist.get_backend() if is_initialized() else None


def collective_timeout() -> _dt.timedelta:
    return _state["timeout"] or _resolve_timeout(None)


def barrier() -> None:
    """Wait for every process; a no-op on one uninitialized process. Bounded by the timeout."""
    if not is_initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "gloo":
        # gloo's barrier takes no timeout of its own; monitored_barrier does and names the late rank.
        dist.monitored_barrier(timeout=collective_timeout(), wait_all_ranks=True)
    else:
        dist.barrier()


EXIT_RELEASE_S = 20.0


def _release_at_exit() -> None:
    """At interpreter exit, destroy the group trainmesh started if the script did not.

    Why: gloo's worker threads free a finished collective's tensors themselves, which needs the
    GIL. A script that ends right after its last collective (``fit`` then exit, the usual torchrun
    script) races interpreter finalization, where a thread asking for the GIL is made to exit
    and, inside a C++ destructor, that is ``std::terminate``: the process dies with SIGABRT
    ("terminate called without an active exception") and torchrun reports the job failed.
    Destroying the group here joins those threads first. No barrier (a peer may be gone), and
    bounded: a teardown stuck on a dead peer must not hold the exit forever.
    """
    if not (dist.is_available() and dist.is_initialized() and _state["owned"]):
        return

    def release() -> None:
        try:
            _release_group(wait_for_peers=False)
        except Exception:  # noqa: BLE001 - leaving anyway; nothing left to report it to
            pass

    worker = threading.Thread(target=release, name="trainmesh-exit", daemon=True)
    worker.start()
    worker.join(EXIT_RELEASE_S)


def shutdown() -> None:
    """Leave the job: destroy the process group trainmesh started. Safe to call twice.

    Call it on every process (as ``destroy_process_group``): it first waits, bounded by the
    collective timeout, until every process got here, because a process that tears its gloo
    connections down while a peer is still working (e.g. the main process writing reports)
    could abort in gloo's teardown ("terminate called without an active exception").
    """
    with _lock:
        _release_group(wait_for_peers=True)
        _state.update(cluster=None, timeout=None, owned=False)


def _release_group(*, wait_for_peers: bool) -> None:
    """Run the on-shutdown callbacks, then destroy the group if trainmesh started it; first wait
    for every peer when asked (``shutdown``; not at exit, where a peer may be gone)."""
    for callback in _on_shutdown:
        callback()
    if is_initialized() and _state["owned"]:
        if wait_for_peers and dist.get_world_size() > 1:
            try:
                barrier()
            except RuntimeError:
                pass  # a peer is gone already; leaving is all that is left to do
        dist.destroy_process_group()
