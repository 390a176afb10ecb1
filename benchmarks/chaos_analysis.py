"""chaos.py's reading of one finished run: the ranks' logs (resumes, completed steps, surveys, faults,
commit lag) and the run's verdict against the reference (bit-identical parameters, steps lost and
recomputed, silent fresh starts), as the script's docstring defines them.

It exists apart from the script because it holds the figures' per-run definitions in one place.
"""

from __future__ import annotations

import os
import re


def read_logs(out: str) -> dict:
    """Attempts (restart count -> resume step, last completed step), surveys and faults."""
    resume, last, survey, faults, lag = {}, {}, {}, [], []
    for name in sorted(os.listdir(out)):
        if not name.startswith("log.rank"):
            continue
        with open(os.path.join(out, name)) as fh:
            for parts in (line.split() for line in fh if line.strip()):
                attempt = int(parts[1])
                if parts[0] == "RESUME":
                    resume.setdefault(attempt, set()).add(int(parts[2]))
                elif parts[0] == "STEP":
                    last[attempt] = max(last.get(attempt, 0), int(parts[3]))
                elif parts[0] == "SURVEY":
                    survey[attempt] = [int(x) for x in parts[2:]]
                elif parts[0] == "FAULT":
                    faults.append(" ".join(parts[2:]))
                elif parts[0] == "COMMIT":
                    lag.append(int(parts[3]) - int(parts[2]))
    return {
        "resume": {k: sorted(v) for k, v in resume.items()},
        "last": last,
        "survey": survey,
        "faults": faults,
        "commit_lag": lag,
    }


def analyse(plan: dict, launch: dict, logs: dict, reference: dict | None, out: str) -> dict:
    import torch

    attempts = sorted(logs["resume"])
    recomputed, destroyed, silent, fresh_with_ckpts = 0, 0, 0, 0
    said_start_over = "starting over" in launch["stdout"]
    for prev, nxt in zip(attempts, attempts[1:]):
        at = logs["resume"][nxt]
        at = max(at)
        recomputed += max(0, logs["last"].get(prev, 0) - at)
        existing = logs["survey"].get(nxt, [])
        if at == 0 and existing:
            fresh_with_ckpts += 1
            silent += 0 if said_start_over else 1
    corrupted = [
        int(re.match(r"corrupt \d+ step_(\d+)/", f).group(1)) for f in logs["faults"] if f.startswith("corrupt")
    ]
    if corrupted and len(attempts) > 1:
        older = [s for s in logs["survey"].get(attempts[1], []) if s < corrupted[0]]
        destroyed = corrupted[0] - (max(older) if older else 0)
    # The checkpoint the restart should have chosen: the newest complete one it found, less a corrupted one.
    first_restart = logs["survey"].get(attempts[1], []) if len(attempts) > 1 else []
    valid = [s for s in first_restart if s not in corrupted]
    newest_valid = max(valid) if valid else 0
    identical, max_abs_diff = False, None
    final_path = os.path.join(out, "final.pt")
    if reference is not None and os.path.exists(final_path):
        final = torch.load(final_path, weights_only=True)
        identical = final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)
        max_abs_diff = (
            max(float((final[k] - reference[k]).abs().max()) for k in reference)
            if final.keys() == reference.keys()
            else None
        )
    hang_named = None
    if plan["kind"] == "sigstop":
        hang_named = "CollectiveTimeoutError" in launch["stderr"] and f"rank(s) [{plan['rank']}]" in launch["stderr"]
    return {
        **plan,
        "exit_code": launch["exit_code"],
        "timed_out": launch["timed_out"],
        "seconds": launch["seconds"],
        "attempts": len(attempts),
        "resumed_at": [max(logs["resume"][a]) for a in attempts],
        "last_step": [logs["last"].get(a, 0) for a in attempts],
        "faults": logs["faults"],
        "newest_valid": newest_valid if len(attempts) > 1 else None,
        "resumed_newest_valid": len(attempts) < 2 or max(logs["resume"][attempts[1]]) == newest_valid,
        "recomputed_steps": recomputed,
        "destroyed_steps": destroyed,
        "lost_steps": max(0, recomputed - destroyed),
        "fresh_starts_with_checkpoints": fresh_with_ckpts,
        "silent_fresh_starts": silent,
        "identical": bool(identical),
        "max_abs_diff": max_abs_diff,
        "hang_named": hang_named,
        "sigcont_sent": launch["sigcont_sent"],
        "sigcont_after_s": launch["sigcont_after_s"],
        "commit_lag_steps": logs["commit_lag"],
        "skipped_warnings": len(re.findall(r"Skipping checkpoint", launch["stderr"])),
        "no_valid_checkpoint_error": "NoValidCheckpointError" in launch["stderr"],
        "not_saved": len(re.findall(r"was not saved", launch["stderr"])),
    }
