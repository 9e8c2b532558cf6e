"""mindlab's one entry point: compose the config, validate it, then train (or print the dry-run plan).

    python train.py model=125m optim.lr=1e-3 trainer.max_steps=2000
    python train.py model=13b parallel=tp8pp2 dry_run=true
    python train.py -m optim.lr=1e-4,3e-4 data.seq_len=256,512
"""
import boot  # noqa: F401  (first: imports MindSpore before anything that loads protobuf)

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
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
    from trainer.loop import save_resolved_config, train

    run_dir = HydraConfig.get().runtime.output_dir
    save_resolved_config(cfg, run_dir)
    print(OmegaConf.to_yaml(cfg, resolve=True))
    print(f"run dir: {run_dir}")
    metrics = train(cfg, run_dir)
    return metrics.get("val_loss")


if __name__ == "__main__":
    main()
