"""Weights & Biases sink: one W&B run per training run, resumed under the same id after a restart."""
import os

import mindspore  # noqa: F401  (must precede wandb's protobuf; see boot.py)
from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError


def wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def check_credentials(requested: str) -> None:
    """Online logging needs credentials (WANDB_API_KEY, `wandb login`'s netrc, an identity token file): checked
    before anything is built, instead of wandb's own error after minutes of data and model building."""
    if wandb_mode(requested) != "online":
        return
    import wandb

    if not wandb.login(prompt=False, verify=False):  # reads the environment and files only; no network
        raise ConfigError("logger.mode", "online, but no W&B credentials: WANDB_API_KEY is not set and "
                          "`wandb login` was not run; set one, or use logger.mode=offline (sync later with `wandb "
                          "sync`) or logger.mode=auto")


class WandbLogger:
    """Logs every metrics.jsonl line under the same keys (x-axis: `step`); summary at the end."""

    def __init__(self, cfg: DictConfig, run_dir: str, run_id: str):
        import wandb

        lg = cfg.logger
        mode = wandb_mode(lg.mode)
        self.run = wandb.init(project=lg.project, entity=lg.entity, group=lg.group, name=lg.run_name,
                              tags=list(lg.tags), job_type=lg.job_type, dir=run_dir, id=run_id, resume="allow",
                              mode=mode, config=OmegaConf.to_container(cfg, resolve=True),
                              settings=wandb.Settings(silent=True, console="off"))
        if mode == "offline":  # said once: where the run is and how to upload it
            print(f"[wandb] offline run in {self.run.settings.sync_dir}; upload it with: wandb sync "
                  f"{self.run.settings.sync_dir}", flush=True)
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
