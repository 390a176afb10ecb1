"""plan_accuracy.py's cases and model: the Llama configuration (smaller under ``--smoke``, read from the
environment so the spawned processes see the same size), the batch, the cases by world size and layout,
and the rows a case's step takes.

It exists apart from the script because the planned side (``plan_accuracy_plan.py``) and the measured
side (``plan_accuracy_measure.py``) both read it: one definition of the work both sides price or run.
"""

from __future__ import annotations

import os


MODEL = dict(
    model_type="llama",
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=4096,
    max_position_embeddings=256,
)
MICRO_BATCH, SEQ = 4, 128
MICROBATCHES = 4  # a pipeline step: 4 microbatches of MICRO_BATCH // 4 rows, the same tokens as the others
CASES = [  # (processes, mesh, zero stage, checkpointing, label)
    (2, "data=2", 0, None, "DP"),
    (2, "data=2", 3, None, "ZeRO-3"),
    (2, "data=1,model=2", 0, None, "TP"),
    (2, "pipe=2,data=1", 0, None, "PP"),
    (4, "data=4", 3, "full", "ZeRO-3+AC"),
    (4, "data=2,model=2", 3, None, "TPxZeRO-3"),
    (4, "pipe=2,data=2", 3, None, "PPxZeRO-3"),
    (8, "pipe=2,data=2,model=2", 3, None, "3-D"),
    (8, "data=4,model=2", 3, None, "TPxZeRO-3"),
]
QUICK = ("DP", "ZeRO-3", "TP", "PP")  # 2 processes: every kind of axis, one launch
# --smoke (the test suite's): the quick cases on a tiny model, one round, a short calibration. The spawned
# processes read the size from the environment (they import this module anew).
SMOKE_ENV = "TRAINMESH_PLAN_ACCURACY_SMOKE"
if os.environ.get(SMOKE_ENV):
    MODEL = dict(
        MODEL,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=32,
    )
    SEQ = 32


def build_model():
    from trainmesh.planner.models import _from_config

    return _from_config(MODEL)


def _is_pipe(mesh: str) -> bool:
    return mesh.startswith("pipe=")


def _rows(mesh: str) -> int:
    return MICRO_BATCH // MICROBATCHES if _is_pipe(mesh) else MICRO_BATCH
