"""A training epoch: the Trainer's inner loop over its steps, the loss and stop syncs, and the metrics.

A mixin of :class:`~trainmesh.trainer.Trainer` (``fit`` calls ``_train_epoch`` once an epoch): it reads
the Trainer's model, callbacks, metrics, precision, throughput meter and fault-tolerance hook, and runs
each step through ``_optimizer_step`` (``optimizer_step.py``).
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from typing import Any

import torch

from trainmesh._torch.reduce import all_reduce_small

from .data_input import TrainSteps
from .log_writer import LogWriter
from .loss_tracking import LossAccumulator
from .metrics import Metric
from .progress import ProgressBar


class EpochLoop:
    def _end_of_resumed_epoch(self, epochs: int) -> dict[str, float]:
        """A checkpoint taken after an epoch's last step but before its end (one written by
        ``ModelCheckpoint``/``ShardedCheckpoint`` before they saved that step at the epoch's end
        only, or a user's own save): the epoch's batches are done, so none is trained again; the
        end-of-epoch work (evaluation, history, callbacks) runs once, now. The epoch's training
        loss is not in such a checkpoint and is recorded as nan."""
        if self.is_main_process:
            warnings.warn(
                f"resumed after the last step of epoch {self.epoch + 1} and before its end: running its "
                f"end-of-epoch work now; its training loss is not in the checkpoint (nan)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._bar = ProgressBar(0, epoch=self.epoch + 1, epochs=epochs, enabled=False)
        return {"loss": math.nan}

    def _train_epoch(self, steps: TrainSteps, epochs: int, writer: LogWriter | None) -> dict[str, float]:
        self.model.train()
        for metric in self.metrics:
            metric.reset()
        steps.set_epoch(self.epoch)
        self.callbacks.on_epoch_begin(self.epoch, {})
        self._bar = ProgressBar(
            len(steps) if steps.has_length() else None,
            epoch=self.epoch + 1,
            epochs=epochs,
            enabled=self._show_progress(),
        )
        losses = LossAccumulator()  # since the last sync
        epoch_loss_sum, epoch_samples = 0.0, 0.0
        sized = steps.has_length()
        num_steps = len(steps) if sized else None
        skipped_before = self._skipped()
        iterator = iter(steps)
        step = 0
        self._meter.restart()
        while True:
            started = time.perf_counter()
            if self._ft is not None:
                self._ft.position()  # before the fetch: where this step's batch starts, if it must come again
            micro_batches = next(iterator, None)
            data_wait = time.perf_counter() - started
            if micro_batches is None:
                break
            if self._ft is not None and self._ft.begin_step():  # quorum; True: healed to a peer's state
                iterator = iter(steps)  # at the peers' data position: their batch for this step
                micro_batches, num_steps = next(iterator), step + 1 + len(steps)
            self._meter.observe(micro_batches, self.loss_fn)  # FLOPs per sample, the first time only
            self.callbacks.on_train_batch_begin(step, {})
            self._beacon.mark(self.global_step + 1)
            try:
                record = self._optimizer_step(micro_batches, losses)
                if record is None:  # a fault-tolerant step that did not commit: its batch comes again
                    iterator = iter(steps)
                    continue
            except RuntimeError as error:  # a collective failed: name who did not arrive
                diagnosed = self._beacon.diagnose(error)
                if diagnosed is None:
                    raise
                raise diagnosed from error
            last = sized and step + 1 == num_steps
            logged = (self.global_step % self.config.log_every_n_steps == 0) or last
            record.update(
                epoch=self.epoch,
                step=step,
                data_wait_s=data_wait,
                step_time_s=time.perf_counter() - started,
                **self.communication.step_record(),
                **self._expert_load.step_record(logged),
                **(self._ft.step_record() if self._ft is not None else {}),
            )
            if logged:
                loss, samples = self._sync(losses)
                if samples:  # a window of skipped steps only has no loss (nan), and adds nothing
                    epoch_loss_sum, epoch_samples = epoch_loss_sum + loss * samples, epoch_samples + samples
                rates = self._meter.report(samples)  # over the wall time since the last log, the whole job's
                record.update(loss=loss, **rates)
                self.history.record_step(record)
                if writer:
                    writer.log_step(record)
                shown = {"loss": loss}
                if self.precision.scaler is not None:
                    shown["skipped"] = self._skipped() - skipped_before
                if "comm_bytes" in record:  # this rank's gradient bytes sent / uncompressed (ratio)
                    shown["comm"] = self.communication.progress_text(record)
                if "moe_imbalance" in record:  # the busiest expert's tokens over the mean (expert_load.py)
                    shown["moe"] = record["moe_imbalance"]
                shown.update(self._meter.progress_values(rates))
                self._bar.update(step + 1, shown, record["samples_per_s"])
            self.callbacks.on_train_batch_end(step, record)
            step += 1
            if self.stop_requested:
                break
        if losses.pending:  # steps after the last sync point (unsized data)
            loss, samples = self._sync(losses)
            if samples:
                epoch_loss_sum, epoch_samples = epoch_loss_sum + loss * samples, epoch_samples + samples
        logs = {"loss": epoch_loss_sum / epoch_samples if epoch_samples else math.nan}
        logs.update(self._reduced_metrics(self.metrics))
        if self.nonfinite_steps:
            logs["nonfinite_steps"] = self.nonfinite_steps
        if self.precision.scaler is not None:
            logs["skipped_steps"] = self._skipped() - skipped_before
            logs["loss_scale"] = self.precision.scaler.scale_value
        return logs

    def _sync(self, losses: LossAccumulator) -> tuple[float, float]:
        """One small all-reduce: the loss since the last sync, and whether anyone wants to stop."""
        loss, samples, stop = losses.sync(self._stop_local)
        self.stop_requested = self.stop_requested or stop
        return loss, samples

    def _agree_on_stop(self) -> None:
        if self.stop_requested:
            return
        reduced = all_reduce_small(torch.tensor([1.0 if self._stop_local else 0.0], dtype=torch.float64))
        self.stop_requested = bool(reduced[0] > 0)

    # --- metrics ------------------------------------------------------------------------
    def _update_metrics(self, outputs: Any, targets: Any) -> None:
        from trainmesh._torch.tensor_parallel import batch_to_local

        outputs, targets = batch_to_local(outputs, self.distribution), batch_to_local(targets, self.distribution)
        for metric in self.metrics:
            metric.update(outputs.float() if torch.is_tensor(outputs) else outputs, targets)

    @staticmethod
    def _reduced_metrics(metrics: list[Metric]) -> dict[str, float]:
        """Exact across processes: sums of states are reduced, never means of per-process results."""
        if not metrics:
            return {}
        states = [m.state().to(torch.float64) for m in metrics]
        reduced = all_reduce_small(torch.cat(states))
        out, offset = {}, 0
        for metric, state in zip(metrics, states):
            out[metric.name] = metric.compute(reduced[offset : offset + len(state)])
            offset += len(state)
        return out

    def _skipped(self) -> int:
        return self.precision.scaler.skipped_steps if self.precision.scaler is not None else 0

    def _show_progress(self) -> bool:
        if not self.is_main_process or self.config.progress is False:
            return False
        return True if self.config.progress is True else (sys.stdout is not None)
