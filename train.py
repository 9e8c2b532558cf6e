"""mindlab's one entry point: compose the config, validate it, then train (or print the dry-run plan).

    python train.py model=125m optim.lr=1e-3 trainer.max_steps=2000
    python train.py model=13b parallel=tp8pp2 dry_run=true
    python train.py -m optim.lr=1e-4,3e-4 data.seq_len=256,512
"""
import boot  # noqa: F401  (first: imports MindSpore before anything that loads protobuf)

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from conf.schema import register
from conf.validate import ConfigError, validate
from trainer.runtime import launched_world_size

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    try:
        validate(cfg, world_size=launched_world_size())
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    if cfg.dry_run:
        from trainer.dry_run import dry_run_report

        print(dry_run_report(cfg))
        return None
    from data import DataError  # the training stack (MindFormers included) loads only when training
    from trainer.checkpoint import CheckpointError
    from trainer.guard import TrainingStopped
    from trainer.loop import save_resolved_config, train
    from trainer.metrics import write_status

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.logger.group is None:
        cfg.logger.group = hydra_cfg.sweep.dir  # one group per `-m` invocation
    if cfg.logger.run_name is None:
        cfg.logger.run_name = hydra_cfg.job.override_dirname or os.path.basename(run_dir)
    save_resolved_config(cfg, run_dir)
    print(OmegaConf.to_yaml(cfg, resolve=True))
    print(f"run dir: {run_dir}")
    write_status(run_dir, "running")
    try:
        metrics = train(cfg, run_dir)
    except (DataError, CheckpointError, TrainingStopped) as err:
        write_status(run_dir, "failed", error=str(err))
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except BaseException as err:
        write_status(run_dir, "failed", error=f"{type(err).__name__}: {err}")
        raise
    write_status(run_dir, "preempted" if metrics.get("preempted") else "finished", step=metrics.get("step"))
    return metrics.get("val_loss")


if __name__ == "__main__":
    main()
