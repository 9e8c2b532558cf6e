"""What happens around the steps, one concern per callback (OLMo-core style). Each has the loop's lifecycle hooks
(Callback); the loop calls them through Callbacks, in the order they were added:

    on_start(step)               before the first step (`step`: where the run starts, 0 or the resumed step)
    on_step(step, result)        after every step (trainer/module.py StepResult)
    on_evaluation(step, metrics) after Evaluation has measured
    on_checkpoint(step)          after Checkpointing has saved
    on_end(step)                 after the last step (or the one a signal stopped at)

    FamilyUpdate   after every step, its update applied or skipped, the model family's own update outside the
                   gradient (its `after_step`: a MoE's routing bias)
    SkipLog        a skipped step's reason, data position and loss
    GuardStop      the spike guard's record of each step: it stops the run (after a checkpoint) on too many skips
    TrainMetrics   every trainer.log_every steps: loss, the objective's metrics, loss tokens per step (and
                   their fraction of the target tokens), lr, grad norm, tokens, speed; for an objective with
                   timings (PPO), where the step's time went
    Evaluation     every trainer.eval_every steps, at the end, and at step 0 with trainer.eval_at_start: the
                   objective's loss and metrics per source, bits per byte (objectives whose loss is a per-token
                   NLL) and the trainer.eval_tasks scores
    Checkpointing  every trainer.save_every steps, at the end and on SIGTERM/SIGINT (trainer/state.py writes it)
    PreemptionNotice  after a signal's checkpoint, the line saying the run exits
    Sinks          where reports go (metrics.jsonl, console, W&B: anything with log(dict) and close()): the
                   evaluations' metrics, closed at the end
    WeightsDigest  at the end of a data-parallel run, each rank's weights' digest (the ranks must agree)
"""
import math
from typing import Callable, Dict, List, Optional

import numpy as np

from evaluation.validation import val_metrics
from trainer.guard import SpikeGuard, TrainingStopped
from trainer.metrics import SpeedMonitor, peak_rss_gb
from trainer.module import StepResult


class Callback:
    """The loop's lifecycle hooks, each doing nothing here: a callback overrides those of its concern."""

    def on_start(self, step: int) -> None:
        pass

    def on_step(self, step: int, result: StepResult) -> None:
        pass

    def on_evaluation(self, step: int, metrics: dict) -> None:
        pass

    def on_checkpoint(self, step: int) -> None:
        pass

    def on_end(self, step: int) -> None:
        pass


class Callbacks(Callback):
    """Every hook called on each callback in turn."""

    def __init__(self):
        self.callbacks: List[Callback] = []

    def add(self, *callbacks: Callback) -> None:
        self.callbacks += callbacks

    def on_start(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_start(step)

    def on_step(self, step: int, result: StepResult) -> None:
        for callback in self.callbacks:
            callback.on_step(step, result)

    def on_evaluation(self, step: int, metrics: dict) -> None:
        for callback in self.callbacks:
            callback.on_evaluation(step, metrics)

    def on_checkpoint(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(step)

    def on_end(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_end(step)


class Sinks(Callback):
    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(metrics)

    def on_evaluation(self, step: int, metrics: dict) -> None:
        self.log({"step": step, **metrics})

    def on_end(self, step: int) -> None:
        for sink in self.sinks:
            sink.close()


class FamilyUpdate(Callback):
    """The model family's `after_step(model, model_cfg)` after every step the loop runs, whether its update was
    applied or skipped (the spike guard, a non-finite loss or gradient, an fp16 overflow): what the step's forward
    recorded is the step's own, as MindFormers' TopkBiasBalanceCallback reads its expert load at every step's end,
    its overflow steps too."""

    def __init__(self, update: Callable, model, model_cfg):
        self.update, self.model, self.model_cfg = update, model, model_cfg

    def on_step(self, step: int, result: StepResult) -> None:
        self.update(self.model, self.model_cfg)


class SkipLog(Callback):
    """A skipped step's line: why, where the data stood before it, its loss (None when not finite)."""

    def __init__(self, sinks: Sinks, train_data):
        self.sinks, self.train_data = sinks, train_data
        self.position = None

    def on_start(self, step: int) -> None:
        self.position = self.train_data.position

    def on_step(self, step: int, result: StepResult) -> None:
        if result.skip:
            self.sinks.log({"step": step, "skipped": result.skip, "data_position": self.position,
                            "loss": result.loss if math.isfinite(result.loss) else None})
        self.position = self.train_data.position


class GuardStop(Callback):
    """Each step's loss recorded by the spike guard (trainer/guard.py), which raises TrainingStopped after too many
    consecutive skips: the run saves `save(step)` first, so it can resume once the cause is fixed."""

    def __init__(self, guard: SpikeGuard, save: Callable[[int], None]):
        self.guard, self.save = guard, save

    def on_step(self, step: int, result: StepResult) -> None:
        try:
            self.guard.record(result.loss, result.skip)
        except TrainingStopped:
            self.save(step)
            raise


class TrainMetrics(Callback):
    """Means over the accepted steps of each logging interval (an all-skipped interval logs nothing)."""

    def __init__(self, sinks: Sinks, every: int, max_steps: int, speed: SpeedMonitor, tokens_per_step: int,
                 tokens_by_source: Callable[[], Dict[str, int]], extra: Callable[[], dict],
                 timings: Optional[Callable[[], Dict[str, float]]] = None):
        """`timings`: the objective's (base/objective.py), whose phases the step's time is split into."""
        self.sinks, self.every, self.max_steps, self.speed = sinks, every, max_steps, speed
        self.tokens_per_step, self.tokens_by_source, self.extra = tokens_per_step, tokens_by_source, extra
        self.window: List[StepResult] = []
        self.last: dict = {}
        self.timings, self.spent, self.run_spent = timings, [], {}

    def on_step(self, step: int, result: StepResult) -> None:
        self.speed.add(self.tokens_per_step)
        self.spent.append(result.seconds)
        if result.skip is None:
            self.window.append(result)
        if self.window and (step % self.every == 0 or step == self.max_steps):
            last = self.window[-1]
            self.last = {"step": step, "loss": float(np.mean([r.loss for r in self.window])),
                         **{k: float(np.mean([r.metrics[k] for r in self.window])) for k in last.metrics},
                         **(self._loss_tokens() if last.loss_tokens is not None else {}),
                         "lr": float(last.lr.asnumpy()), "grad_norm": float(last.grad_norm.asnumpy()),
                         "tokens_seen": step * self.tokens_per_step, **self.speed.measure(), **self.extra(),
                         "peak_rss_gb": peak_rss_gb(),
                         **{f"tokens_seen/{source}": n for source, n in self.tokens_by_source().items()},
                         **self._times()}
            self.window = []
            self.sinks.log(self.last)

    def _times(self) -> dict:
        """Seconds per step over the steps since the last log (skipped ones too): time/step, the loop's making of
        the inputs and the update, the inputs split into the objective's phases (`timings`: PPO's rollout,
        reward, reference), and each part's share of the step as time_share/<part>; {} without `timings`."""
        if self.timings is None or not self.spent:
            self.spent = []
            return {}
        seconds = {**self.timings(), "update": sum(s.get("update", 0.0) for s in self.spent)}
        seconds["step"] = sum(s.get("inputs", 0.0) + s.get("update", 0.0) for s in self.spent)
        for part, value in seconds.items():
            self.run_spent[part] = self.run_spent.get(part, 0.0) + value
        self.run_spent["steps"] = self.run_spent.get("steps", 0) + len(self.spent)
        out = {f"time/{part}": value / len(self.spent) for part, value in seconds.items()}
        out.update({f"time_share/{part}": value / max(seconds["step"], 1e-12) for part, value in seconds.items()
                    if part != "step"})
        self.spent = []
        return out

    def time_line(self) -> Optional[str]:
        """Where the run's step time went, one line (None without the objective's `timings`)."""
        if not self.run_spent:
            return None
        steps, total = self.run_spent["steps"], self.run_spent["step"]
        parts = [f"{part} {value / steps:.3f} s ({value / max(total, 1e-12):.0%})"
                 for part, value in self.run_spent.items() if part not in ("step", "steps")]
        return f"[time] per step over {steps} steps: {', '.join(parts)} of {total / steps:.3f} s"

    def _loss_tokens(self) -> dict:
        """Tokens that carried loss per step, and their share of the step's target tokens."""
        n = float(np.mean([r.loss_tokens for r in self.window]))
        return {"loss_tokens": n, "loss_token_fraction": n / self.tokens_per_step}


class Evaluation(Callback):
    """val_loss (token-weighted over all sources) and per source val_loss/<source>; the objective's metrics as
    val_<metric> and val_<metric>/<source> (evaluation/validation.py, as `python -m evaluation`). With `val_bytes`
    (per source, the UTF-8 bytes of the loss targets, given when the loss is their mean NLL in nats): val_ppl,
    val_bpb and val_bpb/<source>, comparable across tokenizers. With `tasks` (a scorer returning
    {"<task>/<metric>": value}, evaluation/tasks.py task_scorer): val_task/<task>/<metric>."""

    def __init__(self, report: Callback, every: int, max_steps: int, at_start: bool, module,
                 val: Dict[str, List[tuple]], val_bytes: Optional[Dict[str, int]] = None,
                 tasks: Optional[Callable[[], dict]] = None):
        """`report`: whose on_evaluation gets the metrics (the loop's Callbacks); `at_start`: evaluate at step 0
        too, the "before" every later evaluation is compared with."""
        self.report, self.every, self.max_steps, self.at_start = report, every, max_steps, at_start
        self.module, self.val, self.val_bytes, self.tasks = module, val, val_bytes, tasks
        self.last: dict = {}

    def evaluate(self) -> dict:
        per_source = {source: self.module.evaluate(batches) for source, batches in self.val.items() if batches}
        out = val_metrics(per_source, self.module.objective.metrics, self.val_bytes)
        if self.tasks:
            out.update({f"val_task/{key}": value for key, value in self.tasks().items()})
        return out

    def log(self, step: int) -> None:
        """Evaluate now and report it as `step` (the loop's step 0: before the first update)."""
        if self.val or self.tasks:
            self.last = self.evaluate()
            self.report.on_evaluation(step, self.last)

    def on_start(self, step: int) -> None:
        if step == 0 and self.at_start:
            self.log(0)

    def on_step(self, step: int, result: StepResult) -> None:
        if (self.every and step % self.every == 0) or step == self.max_steps:
            self.log(step)


class Checkpointing(Callback):
    """When to save: `save(step)` writes the checkpoint (trainer/state.py Checkpointer asks every part for its
    state), then `report`'s on_checkpoint hears of it."""

    def __init__(self, save: Callable[[int], None], report: Callback, every: int, max_steps: int, preemption):
        self.save, self.report, self.every, self.max_steps, self.preemption = save, report, every, max_steps, preemption

    def on_step(self, step: int, result: StepResult) -> None:
        if (self.every and step % self.every == 0) or step == self.max_steps or self.preemption.signal:
            self.save(step)
            self.report.on_checkpoint(step)


class PreemptionNotice(Callback):
    """The line that says a signal's checkpoint is written and the run exits (trainer/runtime.py Preemption)."""

    def __init__(self, preemption):
        self.preemption = preemption

    def on_checkpoint(self, step: int) -> None:
        if self.preemption.signal:
            print(f"[checkpoint] {self.preemption.signal}: saved step {step}, exiting")


class WeightsDigest(Callback):
    """Each rank's weights' sha256 at the end of a data-parallel run: equal on every rank, or the ranks drifted."""

    def __init__(self, model, rank: int):
        self.model, self.rank = model, rank

    def on_end(self, step: int) -> None:
        from distributed.data_parallel import weights_digest

        print(f"[data-parallel] rank {self.rank} weights sha256 {weights_digest(self.model)}", flush=True)
