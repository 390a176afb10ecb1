"""Run every benchmark and write one results file.

    python benchmarks/run_all.py [--quick] [--only a,b] [--resume | --refresh] --json PATH

Each benchmark in ``REGISTRY`` runs as its own subprocess, one after another (never two at once:
they time things), with ``--json`` pointing at a temporary file and one thread per process. The
output holds ``commit``, ``date``, ``machine``, ``versions``, the load average around every
benchmark, each benchmark's full detail, and a merged top-level ``figures`` (name -> number).

A benchmark is skipped, with the reason recorded, when its script is missing, an optional package
it needs is not importable, or it needs root (network namespaces) and this is not root. A
benchmark that exits non-zero and printed INVALID did not compare equal work: its figures are kept
in its detail but left out of the top-level ``figures``, and ``invalid`` names it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name, script, modules it needs beyond trainmesh's runtime deps, needs root, extra args of a full run.
# The scripts of other work streams are listed here too; a missing one is skipped with the reason.
REGISTRY = [
    {"name": "ddp_overhead", "script": "ddp_overhead.py", "needs": []},
    {"name": "trainer_overhead", "script": "trainer_overhead.py", "needs": ["accelerate", "lightning_fabric"]},
    # 3 interleaved rounds in a full run: the step-time ratio gets a 95% range over rounds
    {"name": "zero_memory", "script": "zero_memory.py", "needs": ["deepspeed"], "full_args": ["--rounds", "3"]},
    {"name": "checkpoint", "script": "checkpoint.py", "needs": []},
    {"name": "dataloader", "script": "dataloader.py", "needs": []},
    {"name": "ps", "script": "ps.py", "needs": ["zmq"]},
    {"name": "compression", "script": "compression.py", "needs": []},
    {"name": "tensor_parallel", "script": "tensor_parallel.py", "needs": ["transformers"]},
    {"name": "pipeline", "script": "pipeline.py", "needs": []},
    {"name": "big_model", "script": "big_model.py", "needs": ["transformers", "safetensors", "accelerate"]},
    {"name": "finetune", "script": "finetune.py", "needs": ["transformers", "peft"]},
    {"name": "moe", "script": "moe.py", "needs": ["transformers"]},
    {"name": "throughput", "script": "throughput.py", "needs": ["transformers"]},
    {"name": "plan_accuracy", "script": "plan_accuracy.py", "needs": ["transformers"]},
    # issue 47's: transformers' own TP and FSDP2 (from_pretrained(..., distributed_config=...)) at 2 and 4 processes
    {"name": "transformers_peer", "script": "transformers_peer.py", "needs": ["transformers", "safetensors"]},
    # issue 43's context parallelism (ring and Ulysses over a sequence axis)
    {"name": "long_context", "script": "long_context.py", "needs": ["transformers"]},
    # issue 35's: one uninterrupted 4-process job and 10 faulty ones (--quick: each fault kind once); the
    # disk-full kind mounts a tmpfs and is skipped, with the reason, when not root
    {"name": "chaos", "script": "chaos.py", "needs": [], "full_args": ["--runs", "10"]},
    # issue 45's: 2 replica groups under torchft's Lighthouse against a restart from checkpoint, seeded SIGKILLs
    {"name": "replica_ft", "script": "replica_ft.py", "needs": ["torchft"]},
    {"name": "communication", "script": "communication.py", "needs": [], "root": True},
    {"name": "multihost", "script": "multihost.py", "needs": [], "root": True},
]

# Fixed figure names that one benchmark reports under its own name: (fixed name, benchmark, its name).
ALIASES = [("planner_vs_measured_peak", "plan_accuracy", "plan_memory_vs_measured_worst")]
# Fixed names the issue assigns to one benchmark: another benchmark's figure of the same name (measured
# in another setting) stays in that benchmark's detail and never stands in for it at the top level.
OWNERS = {
    name: "compression"
    for name in (
        "int8_payload_reduction",
        "topk1_payload_reduction",
        "int8_wire_bytes_reduction",
        "topk1_wire_bytes_reduction",
        "int8_final_loss_vs_fp32",
        "topk1_final_loss_vs_fp32",
    )
}


# Absolute paths of this machine (checkout, temp files, interpreter) say nothing about the results
# and must not land in the committed file: every string is scrubbed before it is written.
_PATH = re.compile(r"(?<![\w.])/(?:[\w.+@-]+/)+[\w.+@-]*")


def scrub(value):
    if isinstance(value, str):
        value = value.replace(ROOT + os.sep, "")
        return _PATH.sub(lambda m: "<path>/" + os.path.basename(m.group(0)), value)
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    return value


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit_info() -> dict:
    head = _run(["git", "rev-parse", "HEAD"])
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))
    return {"commit": head[:12] if head else "unknown", "dirty": dirty}


def machine_info() -> dict:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as fh:
            mem_gib = round(int(next(line.split()[1] for line in fh if line.startswith("MemTotal"))) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    import torch

    # A virtual machine's model name can hide the generation ("AMD EPYC" with AVX2 only, or with
    # AVX512-BF16): the vector units torch uses, and what bf16 costs, tell runs on different hardware apart.
    from trainmesh.trainer.precision import bf16_matmul_speedup

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_matmul_vs_fp32": round(bf16_matmul_speedup("cpu"), 3),
        "memory_gib": mem_gib,
        "system": platform.system(),
        "release": platform.release(),
        "python": platform.python_version(),
        "gpu": "none (CPU, gloo)",
    }


def versions() -> dict:
    out = {}
    for module in (
        "torch",
        "numpy",
        "trainmesh",
        "zmq",
        "transformers",
        "accelerate",
        "lightning_fabric",
        "deepspeed",
        "matplotlib",
    ):
        if importlib.util.find_spec(module) is None:
            out[module] = None
            continue
        code = f"import {module} as m; print(getattr(m, '__version__', '?'))"
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, DS_ACCELERATOR="cpu"),
        )
        out[module] = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None
    return out


def skip_reason(entry: dict) -> str | None:
    if not os.path.exists(os.path.join(HERE, entry["script"])):
        return f"benchmarks/{entry['script']} is not in this checkout"
    missing = [m for m in entry["needs"] if importlib.util.find_spec(m) is None]
    if missing:
        return f"optional package(s) not importable: {', '.join(missing)} (pip install -e '.[bench]')"
    if entry.get("root") and os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) for the network-namespace cluster"
    return None


def run_one(entry: dict, quick: bool, timeout: float) -> dict:
    reason = skip_reason(entry)
    if reason:
        print(f"[{entry['name']}] skipped: {reason}", flush=True)
        return {"status": "skipped", "reason": reason, "figures": {}}
    with tempfile.TemporaryDirectory(prefix="trainmesh-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.join(HERE, entry["script"]), "--json", out] + (
            ["--quick"] if quick else entry.get("full_args", [])
        )
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
        load_before, started = os.getloadavg(), time.perf_counter()
        shown = " ".join([f"benchmarks/{entry['script']}", "--json", "PATH"] + cmd[4:])
        print(f"[{entry['name']}] {shown} (load {load_before[0]:.2f})", flush=True)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as error:
            rc, stdout, stderr = (
                None,
                (error.stdout or b"").decode(errors="replace")
                if isinstance(error.stdout, bytes)
                else (error.stdout or ""),
                f"timed out after {timeout:.0f} s",
            )
        seconds = time.perf_counter() - started
        detail = None
        if os.path.exists(out):
            with open(out) as fh:
                detail = json.load(fh)
    invalid = "INVALID" in stdout or "INVALID" in (stderr or "")  # some print it to stderr
    status = "ok" if rc == 0 and detail is not None else "invalid" if invalid else "failed"
    figures = (detail or {}).get("figures") or {}
    print(f"[{entry['name']}] {status} in {seconds:.0f} s: {json.dumps(figures)}", flush=True)
    return {
        "status": status,
        "exit_code": rc,
        "seconds": round(seconds, 1),
        "command": shown,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "figures": figures,
        "detail": detail,
        "stdout_tail": stdout[-6000:],
        "stderr_tail": stderr[-3000:],
    }


def merge_figures(benchmarks: dict) -> tuple[dict, dict]:
    """Top-level figures from every valid benchmark; where two report one name, the first keeps it."""
    figures, sources = {}, {}
    for name, result in benchmarks.items():
        if result["status"] != "ok":
            continue
        for key, value in result["figures"].items():
            if OWNERS.get(key, name) != name:
                continue
            if key not in figures and isinstance(value, (int, float)) and not isinstance(value, bool):
                figures[key], sources[key] = value, name
    for fixed, bench, own in ALIASES:
        result = benchmarks.get(bench, {})
        if fixed not in figures and result.get("status") == "ok" and own in result["figures"]:
            figures[fixed], sources[fixed] = result["figures"][own], f"{bench}:{own}"
    return figures, sources


def write_report(report: dict, path: str, unfinished: list[str]) -> None:
    # In the registry's order, whatever order they ran in (a resumed or refreshed run appends): where two
    # benchmarks report one figure name, the first keeps it (merge_figures), so the order must not move.
    order = {entry["name"]: i for i, entry in enumerate(REGISTRY)}
    report["benchmarks"] = dict(sorted(report["benchmarks"].items(), key=lambda item: order.get(item[0], len(order))))
    report["load_avg_end"] = os.getloadavg()
    report["figures"], report["figure_sources"] = merge_figures(report["benchmarks"])
    report["invalid"] = [n for n, r in report["benchmarks"].items() if r["status"] == "invalid"]
    report["failed"] = [n for n, r in report["benchmarks"].items() if r["status"] == "failed"]
    report["skipped"] = {n: r["reason"] for n, r in report["benchmarks"].items() if r["status"] == "skipped"}
    report["unfinished"] = unfinished
    partial = path + ".partial"
    with open(partial, "w") as fh:
        json.dump(scrub(report), fh, indent=1, sort_keys=False)
    os.replace(partial, path)


def resumed_report(path: str, fresh: dict) -> dict:
    """The report at ``path`` with only its finished benchmarks, to be continued by this run.

    A long full run can be cut (a session's end, a reboot). Its figures stay one run's only if the code
    measured is the same: the commit must match and neither tree may be dirty, else this exits naming
    the difference. Benchmarks that failed, were invalid or were not reached run again."""
    if not os.path.exists(path):
        raise SystemExit(f"--resume: {path} does not exist; run without --resume to start one")
    with open(path) as fh:
        old = json.load(fh)
    for key in ("commit", "mode"):
        if old.get(key) != fresh[key]:
            raise SystemExit(f"--resume: {path} has {key} {old.get(key)!r}, this run {fresh[key]!r}")
    if old.get("dirty") or fresh["dirty"]:
        raise SystemExit("--resume: a dirty tree (uncommitted changes to tracked files) cannot be resumed")
    kept = {n: r for n, r in old.get("benchmarks", {}).items() if r.get("status") in ("ok", "skipped")}
    resumed = old.get("resumed", []) + [{"date": fresh["date"], "load_avg_start": fresh["load_avg_start"]}]
    return {**old, "benchmarks": kept, "resumed": resumed}


def changed_files(old: str, new: str) -> list[str] | None:
    """The files under src/ and benchmarks/ (the measured code and its benchmarks; not the results or
    their tables) that differ between two commits, or None when git cannot say."""
    if old in ("", "unknown") or new in ("", "unknown"):
        return None
    try:
        proc = subprocess.run(
            ["git", "diff", "--name-only", f"{old}..{new}", "--", "src", "benchmarks"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return [f for f in proc.stdout.split() if not f.startswith("benchmarks/results/") and f != "benchmarks/README.md"]


def refreshed_report(path: str, fresh: dict, names: list[str]) -> dict:
    """The report at ``path``, its ``names`` to be measured again at this commit, the rest kept.

    For a benchmark whose measured code changed after a full run (the run takes two hours): each entry
    says the commit it was measured at, the file's ``commit`` stays the full run's, and ``refreshed`` records,
    for every older commit still in the file, which files of src/ and benchmarks/ changed since, so a
    reader can check that the entries kept measure the same code. Same mode and a clean tree only."""
    if not names:
        raise SystemExit("--refresh needs --only: the benchmarks to measure again")
    if not os.path.exists(path):
        raise SystemExit(f"--refresh: {path} does not exist; run without --refresh to start one")
    with open(path) as fh:
        old = json.load(fh)
    if old.get("mode") != fresh["mode"]:
        raise SystemExit(f"--refresh: {path} has mode {old.get('mode')!r}, this run {fresh['mode']!r}")
    if old.get("dirty") or fresh["dirty"]:
        raise SystemExit("--refresh: a dirty tree (uncommitted changes to tracked files) cannot be refreshed")
    kept = {}
    for name, entry in old.get("benchmarks", {}).items():
        if name not in names:
            kept[name] = {**entry, "commit": entry.get("commit", old.get("commit"))}
    older = sorted({entry["commit"] for entry in kept.values() if entry.get("commit") != fresh["commit"]})
    record = {
        "date": fresh["date"],
        "commit": fresh["commit"],
        "benchmarks": names,
        "load_avg_start": fresh["load_avg_start"],
        "machine": fresh["machine"],
        "versions": fresh["versions"],
        "changed_since": {commit: changed_files(commit, fresh["commit"]) for commit in older},
    }
    return {
        **old,  # its commit and date stay the full run's: most entries are that run's
        "benchmarks": kept,
        "refreshed": old.get("refreshed", []) + [record],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", required=True, help="write the merged results here")
    parser.add_argument("--quick", action="store_true", help="every benchmark's --quick (a smoke run each)")
    parser.add_argument("--only", default="", help="comma list of benchmark names (default: all)")
    parser.add_argument("--timeout", type=float, help="seconds per benchmark (default 3600; --quick 600)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run written to --json PATH (same commit, clean tree, same mode): keep what it "
        "finished, run what it did not reach or what failed",
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="measure the --only benchmarks again at this commit into the results at --json PATH (same "
        "mode, clean tree), keeping the others; each entry records its commit, and the file the files "
        "changed since each older one",
    )
    args = parser.parse_args(argv)
    names = [e["name"] for e in REGISTRY]
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in names]
    if unknown:
        parser.error(f"--only names unknown benchmarks {unknown}; known: {names}")
    timeout = args.timeout or (600.0 if args.quick else 3600.0)
    started = datetime.datetime.now(datetime.timezone.utc)
    report = {
        **commit_info(),
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "mode": "quick" if args.quick else "full",
        "machine": machine_info(),
        "versions": versions(),
        "load_avg_start": os.getloadavg(),
        "benchmarks": {},
    }
    if args.resume and args.refresh:
        parser.error("--resume and --refresh cannot be combined")
    if args.resume:
        report = resumed_report(args.json, report)
    if args.refresh:
        report = refreshed_report(args.json, report, only)
    chosen = [entry for entry in REGISTRY if not only or entry["name"] in only]
    for done, entry in enumerate(chosen, 1):
        if entry["name"] in report["benchmarks"]:
            continue  # finished by the run this one resumes
        measured_at = commit_info()["commit"]
        report["benchmarks"][entry["name"]] = {**run_one(entry, args.quick, timeout), "commit": measured_at}
        # Written after every benchmark: a run cut short (a session's end, a kill) still leaves the
        # figures it measured, with ``unfinished`` naming what it did not reach.
        write_report(report, args.json, [e["name"] for e in chosen[done:]])
    print(
        f"\n{len(report['figures'])} figures; invalid {report['invalid']}; failed {report['failed']}; "
        f"skipped {sorted(report['skipped'])}; wrote {args.json}"
    )
    return 1 if report["invalid"] or report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
