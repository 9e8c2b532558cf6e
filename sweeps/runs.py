"""One `Run` per job dir of a Hydra multirun: its overrides, status, resolved config and metrics.jsonl."""
import json
import os
import statistics
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from base.errors import UserError
from base.schema import global_batch_size

SKIP_DIRS = {".hydra", ".submitit", "checkpoints", "wandb"}


@dataclass(eq=False)  # a run is its job dir: compared by identity
class Run:
    name: str  # job dir, relative to the sweep dir
    num: Optional[int]  # hydra.job.num
    overrides: dict  # key as written on the command line (`optim.lr`, `+sweep`, `data`) -> value string
    config: dict  # resolved config.yaml; {} if the job stopped before writing it
    status: str  # running | finished | preempted | failed (status.json) | unknown (no status.json)
    error: Optional[str]
    updated: float  # newest mtime of status.json / metrics.jsonl / the dir (seconds since the epoch)
    train: list  # metrics.jsonl lines with a train loss
    evals: list  # lines with val_loss
    skipped: int  # lines for skipped updates

    @property
    def last_step(self) -> Optional[int]:
        steps = [m["step"] for m in self.train + self.evals]
        return max(steps) if steps else None

    @property
    def final_loss(self) -> Optional[float]:
        return self.train[-1]["loss"] if self.train else None

    @property
    def tokens_seen(self) -> Optional[int]:
        return self.train[-1]["tokens_seen"] if self.train else None

    @property
    def final_val_loss(self) -> Optional[float]:
        return self.evals[-1]["val_loss"] if self.evals else None

    @property
    def best_eval(self) -> Optional[dict]:
        return min(self.evals, key=lambda m: m["val_loss"]) if self.evals else None

    @property
    def tokens_per_sec(self) -> Optional[float]:
        return self._steady("tokens_per_sec")

    @property
    def mfu(self) -> Optional[float]:
        return self._steady("mfu")

    @property
    def peak_rss_gb(self) -> Optional[float]:
        values = [m["peak_rss_gb"] for m in self.train if "peak_rss_gb" in m]
        return max(values) if values else None

    @property
    def final_val_by_source(self) -> dict:
        """source -> val loss at the last evaluation."""
        last = self.evals[-1] if self.evals else {}
        return {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("val_loss/")}

    @property
    def final_val_metrics(self) -> dict:
        """The objective's metrics at the last evaluation, over all sources (e.g. DPO's rewards/accuracies):
        val_<metric> keys other than the loss, perplexity and the per-source ones."""
        last = self.evals[-1] if self.evals else {}
        sources = tuple(f"/{s}" for s in self.final_val_by_source)
        return {k[4:]: v for k, v in last.items() if k.startswith("val_") and k not in ("val_loss", "val_ppl")
                and not k.endswith(sources)}

    @property
    def tokens_per_step(self) -> Optional[int]:
        if not self.config:
            return None
        return global_batch_size(OmegaConf.create(self.config)) * self.config["data"]["seq_len"]

    def _steady(self, key: str) -> Optional[float]:
        """Median over the logged intervals after the first (which holds graph compilation), if there are any."""
        values = [m[key] for m in self.train if key in m]
        return statistics.median(values[1:] if len(values) > 1 else values) if values else None


def load_sweep(sweep_dir: str) -> list:
    """Every job dir under `sweep_dir` (any dir holding .hydra/overrides.yaml), in job order."""
    runs = []
    for path, dirs, _ in os.walk(sweep_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        if os.path.isfile(os.path.join(path, ".hydra", "overrides.yaml")):
            runs.append(load_run(path, os.path.relpath(path, sweep_dir)))
            dirs[:] = []
    return sorted(runs, key=lambda r: (r.num is None, r.num if r.num is not None else 0, r.name))


def load_run(path: str, name: str) -> Run:
    overrides = dict(_split_override(o) for o in _read_yaml(os.path.join(path, ".hydra", "overrides.yaml")))
    hydra_yaml = os.path.join(path, ".hydra", "hydra.yaml")
    num = _read_yaml(hydra_yaml).hydra.job.get("num") if os.path.isfile(hydra_yaml) else None
    config_path = os.path.join(path, "config.yaml")
    config = OmegaConf.to_container(_read_yaml(config_path)) if os.path.isfile(config_path) else {}
    status = _read_json(os.path.join(path, "status.json")) or {"status": "unknown"}
    lines = read_metrics(os.path.join(path, "metrics.jsonl"))
    mtimes = [os.path.getmtime(p) for p in (os.path.join(path, f) for f in ("status.json", "metrics.jsonl"))
              if os.path.exists(p)]
    return Run(name=name, num=num, overrides=overrides, config=config, status=status["status"],
               error=status.get("error"), updated=max(mtimes, default=os.path.getmtime(path)),
               train=[m for m in lines if "loss" in m and "skipped" not in m],
               evals=[m for m in lines if "val_loss" in m], skipped=sum("skipped" in m for m in lines))


def read_metrics(path: str) -> list:
    """metrics.jsonl as dicts; a last line still being written (no newline yet) is left out."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        complete = f.read().split("\n")[:-1]
    return [_json(line, f"{path}:{number}") for number, line in enumerate(complete, 1) if line.strip()]


def varied_params(runs: list) -> list:
    """Override keys whose value is not the same in every run (absent counts as a value), in first-seen order."""
    keys = list(dict.fromkeys(k for r in runs for k in r.overrides))
    return [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]


def best_run(runs: list) -> Optional[Run]:
    """Lowest final val loss among finished runs (among all runs with a val loss if none finished)."""
    scored = [r for r in runs if r.final_val_loss is not None]
    finished = [r for r in scored if r.status == "finished"]
    return min(finished or scored, key=lambda r: r.final_val_loss, default=None)


def _split_override(override: str) -> tuple:
    key, _, value = override.partition("=")
    return key, value


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return _json(f.read(), path)


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as err:
        raise UserError(f"{where}: not valid JSON ({err}); the file was cut short or edited: fix or delete it "
                        f"(or leave its run dir out of the sweep dir)") from None


def _read_yaml(path: str):
    try:
        return OmegaConf.load(path)
    except Exception as err:  # yaml's parser errors have no common base with OmegaConf's
        raise UserError(f"{path}: not valid YAML ({str(err).splitlines()[0]}); fix or delete its run dir") from None
