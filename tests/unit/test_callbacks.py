"""Callbacks against a small fake trainer: stopping epochs, best weights, checkpoint files, fan-out."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from trainmesh.trainer.callbacks import (
    HOOKS,
    Callback,
    CallbackList,
    EarlyStopping,
    LambdaCallback,
    ModelCheckpoint,
)

pytestmark = pytest.mark.timeout(60)


class FakeTrainer:
    """What callbacks may use of the Trainer, recorded."""

    def __init__(self, is_main_process: bool = True):
        self.unwrapped_model = torch.nn.Linear(2, 1)
        self.is_main_process = is_main_process
        self.stop_requested = False
        self.stop_reasons: list[str] = []
        self.saved: list[tuple[str, int]] = []
        self.epoch = 0

    def request_stop(self, reason: str) -> None:
        self.stop_requested = True
        self.stop_reasons.append(reason)

    def save_checkpoint(self, path: str) -> None:
        self.saved.append((os.path.basename(path), self.epoch))
        if self.is_main_process:
            torch.save({"epoch": self.epoch, "model": self.unwrapped_model.state_dict()}, path)


def fit(trainer: FakeTrainer, callbacks: list[Callback], values: list[float], key: str = "val_loss") -> list[int]:
    """A fit loop: the weights become the epoch number, then the epoch's logs go to the callbacks."""
    cbs = CallbackList(callbacks, trainer)
    cbs.on_train_begin()
    ran = []
    for epoch, value in enumerate(values):
        trainer.epoch = epoch
        cbs.on_epoch_begin(epoch)
        with torch.no_grad():
            for p in trainer.unwrapped_model.parameters():
                p.fill_(float(epoch))
        cbs.on_epoch_end(epoch, {"loss": 0.0, key: value})
        ran.append(epoch)
        if trainer.stop_requested:
            break
    cbs.on_train_end()
    return ran


def weight_value(trainer: FakeTrainer) -> float:
    return trainer.unwrapped_model.weight[0, 0].item()


# ---------------------------------------------------------------------- EarlyStopping


def test_stops_after_patience_epochs_without_improvement():
    trainer, stop = FakeTrainer(), EarlyStopping(patience=2)
    ran = fit(trainer, [stop], [1.0, 0.8, 0.9, 0.85, 0.7, 0.6])
    assert ran == [0, 1, 2, 3]  # epochs 2 and 3 do not improve on 0.8
    assert stop.stopped_epoch == 3 and stop.best == 0.8 and stop.best_epoch == 1
    assert len(trainer.stop_reasons) == 1 and "val_loss" in trainer.stop_reasons[0]


def test_patience_zero_stops_at_first_bad_epoch_but_never_after_epoch_zero():
    trainer = FakeTrainer()
    assert fit(trainer, [EarlyStopping(patience=0)], [1.0, 0.9, 0.95, 0.5]) == [0, 1, 2]
    assert fit(FakeTrainer(), [EarlyStopping(patience=0)], [1.0]) == [0]


def test_improvements_within_min_delta_do_not_count():
    stop = EarlyStopping(patience=1, min_delta=0.1)
    assert fit(FakeTrainer(), [stop], [1.0, 0.95, 0.91, 0.5]) == [0, 1]
    assert stop.best == 1.0
    # Sign of min_delta is ignored (Keras takes abs), and max mode needs a rise above it.
    up = EarlyStopping(monitor="val_accuracy", patience=1, min_delta=-0.1)
    assert fit(FakeTrainer(), [up], [0.5, 0.65, 0.7], key="val_accuracy") == [0, 1, 2]
    assert up.best == 0.65


@pytest.mark.parametrize("monitor", ["val_accuracy", "val_acc", "accuracy", "top_k_acc"])
def test_auto_mode_maximizes_accuracies(monitor):
    stop = EarlyStopping(monitor=monitor, patience=1)
    assert stop.mode == "max"
    assert fit(FakeTrainer(), [stop], [0.5, 0.6, 0.55, 0.9], key=monitor) == [0, 1, 2]
    assert stop.best == 0.6


def test_mode_resolution():
    assert EarlyStopping(monitor="loss").mode == "min"
    assert EarlyStopping(monitor="val_mse", mode="min").mode == "min"
    with pytest.raises(ValueError, match="Received: monitor='val_auc'"):
        EarlyStopping(monitor="val_auc")
    with pytest.raises(ValueError, match="Received: mode='up'"):
        EarlyStopping(mode="up")
    with pytest.raises(ValueError, match="Received: patience=-1"):
        EarlyStopping(patience=-1)


def test_restore_best_weights_on_train_end():
    trainer, stop = FakeTrainer(), EarlyStopping(patience=2, restore_best_weights=True)
    fit(trainer, [stop], [1.0, 0.5, 0.9, 0.8])
    assert stop.best_epoch == 1
    assert weight_value(trainer) == 1.0  # epoch 3 left 3.0 in the model
    assert torch.equal(trainer.unwrapped_model.bias, torch.tensor([1.0]))
    assert all(t.device.type == "cpu" for t in stop.best_weights.values())


def test_restore_best_weights_also_without_an_early_stop():
    trainer = FakeTrainer()
    fit(trainer, [EarlyStopping(patience=10, restore_best_weights=True)], [1.0, 0.2, 0.4])
    assert weight_value(trainer) == 1.0


def test_weights_are_kept_as_they_were_without_restore():
    trainer = FakeTrainer()
    fit(trainer, [EarlyStopping(patience=1)], [1.0, 0.5, 0.9, 0.8])
    assert weight_value(trainer) == 2.0


def test_snapshot_is_a_copy_not_a_view():
    trainer, stop = FakeTrainer(), EarlyStopping(restore_best_weights=True)
    stop.set_trainer(trainer)
    stop.on_train_begin()
    with torch.no_grad():
        trainer.unwrapped_model.weight.fill_(7.0)
    stop.on_epoch_end(0, {"val_loss": 1.0})
    with torch.no_grad():
        trainer.unwrapped_model.weight.fill_(-1.0)
    assert stop.best_weights["weight"].eq(7.0).all()


def test_baseline_not_beaten_stops_after_patience():
    # Improving epochs reset patience only when they also beat the baseline (Keras).
    stop = EarlyStopping(patience=2, baseline=0.5)
    assert fit(FakeTrainer(), [stop], [0.9, 0.95, 0.97, 0.96]) == [0, 1]
    beaten = EarlyStopping(patience=2, baseline=0.5)
    assert fit(FakeTrainer(), [beaten], [0.9, 0.4, 0.45, 0.44, 0.3]) == [0, 1, 2, 3]


def test_missing_monitor_warns_and_never_stops():
    trainer, stop = FakeTrainer(), EarlyStopping(monitor="val_loss", patience=0)
    with pytest.warns(UserWarning, match="'val_loss'.*Available: loss, val_accuracy"):
        ran = fit(trainer, [stop], [0.1, 0.2, 0.3], key="val_accuracy")
    assert ran == [0, 1, 2] and not trainer.stop_requested


def test_nan_never_counts_as_improvement():
    stop = EarlyStopping(patience=1)
    assert fit(FakeTrainer(), [stop], [1.0, float("nan"), float("nan"), 0.1]) == [0, 1]
    assert stop.best == 1.0


def test_one_instance_serves_two_fits():
    stop = EarlyStopping(patience=1)
    fit(FakeTrainer(), [stop], [0.1, 0.5, 0.6])
    # A fresh fit must not compare against the first fit's best (0.1).
    assert fit(FakeTrainer(), [stop], [1.0, 0.9, 0.8]) == [0, 1, 2]


# -------------------------------------------------------------------- ModelCheckpoint


def test_checkpoint_writes_last_every_epoch_and_best_on_improvement(tmp_path):
    trainer = FakeTrainer()
    ckpt = ModelCheckpoint(tmp_path / "ckpt")
    fit(trainer, [ckpt], [1.0, 0.5, 0.7, 0.4, 0.6])
    best_saves = [epoch for name, epoch in trainer.saved if name == "best.pt"]
    last_saves = [epoch for name, epoch in trainer.saved if name == "last.pt"]
    assert best_saves == [0, 1, 3]
    assert last_saves == [0, 1, 2, 3, 4]
    assert torch.load(tmp_path / "ckpt" / "best.pt")["epoch"] == 3
    last = torch.load(tmp_path / "ckpt" / "last.pt")
    assert last["epoch"] == 4 and last["model"]["weight"].eq(4.0).all()
    assert ckpt.best == 0.4 and ckpt.best_epoch == 3


def test_checkpoint_max_mode_and_switches(tmp_path):
    trainer = FakeTrainer()
    fit(
        trainer,
        [ModelCheckpoint(tmp_path, monitor="val_accuracy", save_last=False)],
        [0.5, 0.4, 0.9],
        key="val_accuracy",
    )
    assert trainer.saved == [("best.pt", 0), ("best.pt", 2)]
    assert not (tmp_path / "last.pt").exists()
    trainer = FakeTrainer()
    # save_best=False needs no direction, even for a name auto mode cannot read.
    fit(trainer, [ModelCheckpoint(tmp_path / "b", monitor="val_auc", save_best=False)], [0.1, 0.2])
    assert trainer.saved == [("last.pt", 0), ("last.pt", 1)]
    assert not (tmp_path / "b" / "best.pt").exists()


def test_checkpoint_missing_monitor_warns_and_still_saves_last(tmp_path):
    trainer = FakeTrainer()
    with pytest.warns(UserWarning, match="ModelCheckpoint"):
        fit(trainer, [ModelCheckpoint(tmp_path)], [0.3, 0.2], key="other")
    assert trainer.saved == [("last.pt", 0), ("last.pt", 1)]


def test_every_rank_calls_save_but_only_main_creates_the_directory(tmp_path):
    worker = FakeTrainer(is_main_process=False)
    fit(worker, [ModelCheckpoint(tmp_path / "ckpt")], [1.0, 0.5])
    assert worker.saved == [("last.pt", 0), ("best.pt", 0), ("last.pt", 1), ("best.pt", 1)]
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------- CallbackList / Lambda


class Recorder(Callback):
    def __init__(self, tag: str, journal: list):
        self.tag, self.journal = tag, journal

    def __getattribute__(self, name):
        if name in HOOKS:
            return lambda *args: self.journal.append((self.tag, name, args))
        return super().__getattribute__(name)


def call_every_hook(cbs: Callback) -> None:
    for i, (hook, takes_index) in enumerate(HOOKS.items()):
        args = (i, {"i": i}) if takes_index else ({"i": i},)
        getattr(cbs, hook)(*args)


def test_callback_list_fans_out_every_hook_in_order():
    journal: list = []
    trainer = FakeTrainer()
    a, b = Recorder("a", journal), Recorder("b", journal)
    cbs = CallbackList([a, b], trainer)
    assert a.trainer is trainer and b.trainer is trainer and len(cbs) == 2 and list(cbs) == [a, b]
    call_every_hook(cbs)
    expected = []
    for i, (hook, takes_index) in enumerate(HOOKS.items()):
        args = (i, {"i": i}) if takes_index else ({"i": i},)
        expected += [("a", hook, args), ("b", hook, args)]
    assert journal == expected
    assert len(HOOKS) == 12 and all(hasattr(Callback, hook) for hook in HOOKS)


def test_callback_list_checks_its_members_and_passes_trainer_to_later_ones():
    trainer = FakeTrainer()
    cbs = CallbackList(None, trainer)
    late = Callback()
    cbs.append(late)
    assert late.trainer is trainer
    with pytest.raises(TypeError, match="Received: callback='nope'"):
        CallbackList(["nope"], trainer)


def test_base_callback_hooks_are_no_ops():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call_every_hook(CallbackList([Callback()], FakeTrainer()))


def test_lambda_callback_calls_given_functions_only():
    calls = []
    cb = LambdaCallback(
        on_train_begin=lambda logs: calls.append(("train_begin", logs)),
        on_epoch_end=lambda epoch, logs: calls.append(("epoch_end", epoch, logs)),
        on_train_batch_end=lambda step, logs: calls.append(("batch_end", step, logs)),
    )
    cbs = CallbackList([cb], FakeTrainer())
    cbs.on_train_begin()
    cbs.on_train_batch_end(3, {"loss": 1.0})
    cbs.on_epoch_begin(0, {})
    cbs.on_epoch_end(0, {"loss": 0.5})
    assert calls == [("train_begin", None), ("batch_end", 3, {"loss": 1.0}), ("epoch_end", 0, {"loss": 0.5})]
    assert LambdaCallback().on_epoch_end(0) is None
    with pytest.raises(TypeError, match="Received: on_epoch_end=3"):
        LambdaCallback(on_epoch_end=3)
    with pytest.raises(TypeError, match="on_epoch_finish"):
        LambdaCallback(on_epoch_finish=print)
