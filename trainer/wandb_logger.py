"""Weights & Biases sink: one W&B run per training run, resumed under the same id after a restart."""
import os

import mindspore  # noqa: F401  (must precede wandb's protobuf; see boot.py)
from omegaconf import DictConfig, OmegaConf


def wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbLogger:
    """Logs every metrics.jsonl line under the same keys (x-axis: `step`); summary at the end."""

    def __init__(self, cfg: DictConfig, run_dir: str, run_id: str):
        import wandb

        lg = cfg.logger
        self.run = wandb.init(project=lg.project, entity=lg.entity, group=lg.group, name=lg.run_name,
                              tags=list(lg.tags), job_type=lg.job_type, dir=run_dir, id=run_id, resume="allow",
                              mode=wandb_mode(lg.mode), config=OmegaConf.to_container(cfg, resolve=True),
                              settings=wandb.Settings(silent=True, console="off"))
        self.best_val, self.throughput = float("inf"), []

    def log(self, metrics: dict) -> None:
        values = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}
        if "skipped" in metrics:
            values["skipped"] = 1
        self.best_val = min(self.best_val, metrics.get("val_loss", self.best_val))
        if "tokens_per_sec" in metrics:
            self.throughput.append(metrics["tokens_per_sec"])
        self.run.log(values, step=metrics["step"])

    def close(self) -> None:
        if self.best_val < float("inf"):
            self.run.summary["best_val_loss"] = self.best_val
        if len(self.throughput) > 1:  # the first interval holds graph compilation
            self.run.summary["mean_tokens_per_sec"] = sum(self.throughput[1:]) / len(self.throughput[1:])
        self.run.finish()
