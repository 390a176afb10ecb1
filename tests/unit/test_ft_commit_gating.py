"""Issue 45: ``should_commit`` gates the loss scaler, metrics and history of a fault-tolerant Trainer.

One process, one replica group, a real torchft Lighthouse and Manager on loopback. The same fp16-mixed
fit runs twice: once clean, once with two steps made to fail their commit (``manager.report_error``,
torchft's own way of discarding a step, as a failed all-reduce does). An uncommitted step's batch
comes again, so if nothing it touched is changed the two runs end identical: parameters, the loss
scaler's state (its clean-step count moves on every committed step), the accuracy metric and every
history record. A scaler update, a metric update or a history record leaking from an uncommitted
step makes them differ.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'trainmesh[ft]')")
from torchft.coordination import LighthouseServer  # noqa: E402

import trainmesh as tm  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]
FAIL_AT = (2, 5)  # step indices (0-based, per epoch) whose first attempt does not commit


class FailCommit(tm.Callback):
    """Before the backward of the given steps' first attempt, report an error to torchft's manager."""

    def __init__(self, fail_at: tuple[int, ...]):
        self.pending = set(fail_at)

    def on_train_batch_begin(self, step, logs=None):
        if step in self.pending:
            self.pending.discard(step)
            self.trainer._ft.sync.manager.report_error(RuntimeError("injected: discard this step"))


def _fit(fail_at: tuple[int, ...]):
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    url = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    data = torch.utils.data.TensorDataset(x, (x.sum(dim=1) > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    trainer = tm.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        callbacks=[FailCommit(fail_at)],
        precision="fp16-mixed",
        progress=False,
        log_every_n_steps=1,
        fault_tolerance=tm.ReplicaGroups(
            replica_group=0, lighthouse=url, advertise_host="127.0.0.1", timeout_s=10, connect_timeout_s=5
        ),
    )
    try:
        history = trainer.fit(data, epochs=2, batch_size=8, shuffle=True)
    finally:
        lighthouse.shutdown()
    volatile = ("time", "step_time_s", "data_wait_s", "samples_per_s", "tokens_per_s", "mfu", "tflops")
    steps = [{k: v for k, v in r.items() if k not in volatile and "per_s" not in k} for r in history.steps]
    return {
        "params": [p.detach().clone() for p in trainer.unwrapped_model.parameters()],
        "scaler": trainer.precision.scaler.state_dict(),
        "epochs": history.history,
        "steps": steps,
        "summary": trainer.replica_summary,
    }


def test_an_uncommitted_step_changes_neither_scaler_nor_metrics_nor_history():
    clean, failed = _fit(()), _fit(FAIL_AT)
    assert clean["summary"]["uncommitted_steps"] == 0 and failed["summary"]["uncommitted_steps"] == len(FAIL_AT)
    assert clean["scaler"]["clean_steps"] > 0  # the scaler moves on committed steps: a leak would show
    assert failed["scaler"] == clean["scaler"]
    assert all(torch.equal(a, b) for a, b in zip(failed["params"], clean["params"]))
    assert len(failed["steps"]) == len(clean["steps"]) == 16  # 2 epochs x 8 committed steps, no more
    for a, b in zip(failed["steps"], clean["steps"]):
        assert {k: a[k] for k in b if k != "uncommitted_steps"} == {k: b[k] for k in b if k != "uncommitted_steps"}
    assert failed["epochs"]["accuracy"] == clean["epochs"]["accuracy"] and len(clean["epochs"]["accuracy"]) == 2
    assert failed["epochs"] == clean["epochs"]  # loss, loss scale, skipped steps per epoch
