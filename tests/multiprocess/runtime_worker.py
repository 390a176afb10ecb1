"""Run by test_runtime_multiprocess.py as a plain subprocess (no harness, no torchrun).

argv[1] selects the scenario; the result is printed as one JSON line prefixed RESULT=.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import trainmesh as tm

torch.set_num_threads(1)


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "explicit":
        cluster = tm.initialize(job_addresses=sys.argv[2], num_processes=2, process_id=int(sys.argv[3]))
    else:
        cluster = tm.initialize()
    result = {
        "rank": tm.rank(),
        "world_size": tm.world_size(),
        "local_rank": tm.local_rank(),
        "source": cluster.source,
        "devices": tm.list_devices(),
        "backend": dist.get_backend(),
        "main": tm.is_main_process(),
    }
    again = tm.initialize()  # idempotent
    result["idempotent"] = again == cluster
    if scenario == "stall":
        if tm.rank() == 1:
            time.sleep(float(os.environ.get("STALL_S", "30")))
        started = time.monotonic()
        try:
            if os.environ.get("STALL_OP") == "all_reduce":
                dist.all_reduce(torch.ones(4))
            else:
                tm.barrier()
            result["barrier"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the point is what it says
            result["barrier"] = f"{type(exc).__name__}: {exc}"[:300]
        result["waited_s"] = time.monotonic() - started
        print("RESULT=" + json.dumps(result), flush=True)
        os._exit(0)  # the peer is still asleep; don't wait in destroy
    value = torch.tensor([float(tm.rank() + 1)])
    dist.all_reduce(value)
    result["sum"] = value.item()
    tm.barrier()
    tm.shutdown()
    result["after_shutdown"] = dist.is_initialized()
    print("RESULT=" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
