"""What happens around the steps, one concern per callback (OLMo-core style). The loop calls, in order,
`on_step(step, result)` after every step; a callback that has something to report hands it to the sinks
(metrics.jsonl, console, W&B: anything with log(dict) and close(); the loop closes them at the end).

    TrainMetrics   every trainer.log_every steps: loss, the objective's metrics, loss tokens per step (and
                   their fraction of the target tokens), lr, grad norm, tokens, speed
    Evaluation     every trainer.eval_every steps and at the end: the objective's loss and metrics per source,
                   bits per byte (objectives whose loss is a per-token NLL) and the trainer.eval_tasks scores
    Checkpointing  every trainer.save_every steps, at the end and on SIGTERM/SIGINT
"""
from typing import Callable, Dict, List, Optional

import numpy as np

from evaluation.validation import val_metrics
from trainer.metrics import SpeedMonitor, peak_rss_gb
from trainer.module import StepResult


class Sinks:
    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class TrainMetrics:
    """Means over the accepted steps of each logging interval (an all-skipped interval logs nothing)."""

    def __init__(self, sinks: Sinks, every: int, max_steps: int, speed: SpeedMonitor, tokens_per_step: int,
                 tokens_by_source: Callable[[], Dict[str, int]], extra: Callable[[], dict]):
        self.sinks, self.every, self.max_steps, self.speed = sinks, every, max_steps, speed
        self.tokens_per_step, self.tokens_by_source, self.extra = tokens_per_step, tokens_by_source, extra
        self.window: List[StepResult] = []
        self.last: dict = {}

    def on_step(self, step: int, result: StepResult) -> None:
        self.speed.add(self.tokens_per_step)
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
                         **{f"tokens_seen/{source}": n for source, n in self.tokens_by_source().items()}}
            self.window = []
            self.sinks.log(self.last)

    def _loss_tokens(self) -> dict:
        """Tokens that carried loss per step, and their share of the step's target tokens."""
        n = float(np.mean([r.loss_tokens for r in self.window]))
        return {"loss_tokens": n, "loss_token_fraction": n / self.tokens_per_step}


class Evaluation:
    """val_loss (token-weighted over all sources) and per source val_loss/<source>; the objective's metrics as
    val_<metric> and val_<metric>/<source> (evaluation/validation.py, as `python -m evaluation`). With `val_bytes`
    (per source, the UTF-8 bytes of the loss targets, given when the loss is their mean NLL in nats): val_ppl,
    val_bpb and val_bpb/<source>, comparable across tokenizers. With `tasks` (a scorer returning
    {"<task>/<metric>": value}, evaluation/tasks.py task_scorer): val_task/<task>/<metric>."""

    def __init__(self, sinks: Sinks, every: int, max_steps: int, module, val: Dict[str, List[tuple]],
                 val_bytes: Optional[Dict[str, int]] = None, tasks: Optional[Callable[[], dict]] = None):
        self.sinks, self.every, self.max_steps, self.module, self.val = sinks, every, max_steps, module, val
        self.val_bytes, self.tasks = val_bytes, tasks
        self.last: dict = {}

    def evaluate(self) -> dict:
        per_source = {source: self.module.evaluate(batches) for source, batches in self.val.items() if batches}
        out = val_metrics(per_source, self.module.objective.metrics, self.val_bytes)
        if self.tasks:
            out.update({f"val_task/{key}": value for key, value in self.tasks().items()})
        return out

    def log(self, step: int) -> None:
        """Evaluate now and log it as `step` (the loop's step 0: before the first update)."""
        if self.val or self.tasks:
            self.last = self.evaluate()
            self.sinks.log({"step": step, **self.last})

    def on_step(self, step: int, result: StepResult) -> None:
        if (self.every and step % self.every == 0) or step == self.max_steps:
            self.log(step)


class Checkpointing:
    """`save(step)` writes a checkpoint (trainer/loop.py builds it: the module's weights and optimizer plus the
    loop's state); this decides when."""

    def __init__(self, save: Callable[[int], None], every: int, max_steps: int, preemption):
        self.save, self.every, self.max_steps, self.preemption = save, every, max_steps, preemption

    def on_step(self, step: int, result: StepResult) -> None:
        if (self.every and step % self.every == 0) or step == self.max_steps or self.preemption.signal:
            self.save(step)
