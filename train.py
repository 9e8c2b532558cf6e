"""mindlab's one entry point: compose the config, validate it, then train (or print the dry-run plan).

    python train.py model=125m optim.lr=1e-3 trainer.max_steps=2000
    python train.py model=13b parallel=tp8pp2 device=ascend910b dry_run=true
    python train.py model=13b parallel=tp8pp2 device=ascend910b nodes=2 node_rank=$R master_addr=$HEAD ...
                                                            # on each of two nodes (README: Across nodes)
    python train.py -m optim.lr=1e-4,3e-4 data.seq_len=256,512
"""
import boot  # noqa: F401  (first: imports MindSpore before anything that loads protobuf)

import contextlib
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from base.checkpoint import inherit
from base.errors import ConfigError, UserError, entry_point, user_error_in
from base.outputs import check_run_dir
from base.schema import REPO_ROOT, world_size
from plugins import register
from base.validate import validate
from distributed.launch import loopback, told_to_other_nodes
from trainer.runtime import is_scheduler, launched_rank, launched_world_size

register()


def swept_values(hydra_cfg) -> str:
    """This job's values of the keys its multirun varies, e.g. `optim.lr=0.001,data.seq_len=512`."""
    parser = OverridesParser.create()
    recorded = os.path.join(hydra_cfg.sweep.dir, "multirun.yaml")  # the basic sweeper's record of the `-m` line
    sweep = OmegaConf.load(recorded).hydra if os.path.exists(recorded) else hydra_cfg  # e.g. Optuna: params only
    swept = {o.key_or_group for o in parser.parse_overrides(list(sweep.overrides.task)) if o.is_sweep_override()}
    swept |= set((sweep.sweeper.get("params") or {}).keys())
    job = [o for o in parser.parse_overrides(list(hydra_cfg.overrides.task)) if o.key_or_group in swept]
    return ",".join(f"{o.key_or_group}={o.get_value_element_as_str()}" for o in job)


def check_multi_node(cfg: DictConfig, hydra_overrides) -> None:
    """A run across nodes: node 0's address, and one run directory given on every node's command line (the
    default is a timestamp, which differs between nodes): the nodes must share it. A loopback master_addr names a
    different machine on every node: the other nodes' msrun would take the master for themselves and start a
    scheduler of their own (docs/parallel.md: a node is a machine; one machine's workers are one node)."""
    if not cfg.master_addr:
        raise ConfigError("master_addr", f"nodes={cfg.nodes} needs node 0's address (msrun's scheduler runs there): "
                          "add master_addr=<host of node_rank=0> on every node")
    if loopback(cfg.master_addr):
        raise ConfigError("master_addr", f"{cfg.master_addr} is a loopback address, which the other nodes cannot "
                          f"reach: give node 0's address on the network the nodes share (e.g. the first of `hostname "
                          f"-I` on node 0); the workers of one machine run without nodes=")
    if not any(o.startswith("hydra.run.dir=") for o in hydra_overrides):
        raise ConfigError("hydra.run.dir", f"nodes={cfg.nodes}: every node's ranks write into one run directory; add "
                          "hydra.run.dir=<the same directory on a filesystem all nodes share> on every node")


class Refused(BaseException):
    """A user error on its way out of a single run: Hydra's job runner catches Exceptions and prints "Error executing
    job with overrides: [...]" before re-raising them, a second line; this passes it by, and `main` unwraps it."""

    def __init__(self, error: UserError):
        super().__init__(str(error))
        self.error = error


@hydra.main(version_base="1.3", config_path=os.path.join(REPO_ROOT, "conf"), config_name="config")
def run(cfg: DictConfig):
    """A user error (base/errors.py) propagates to `main`, which prints it as one line."""
    try:
        return run_job(cfg)
    except Exception as err:
        user = user_error_in(err)  # (also one an OmegaConf resolver raised, wrapped in OmegaConf's own error)
        if user is None or HydraConfig.get().mode == RunMode.MULTIRUN:  # a sweep's failed job stays Hydra's
            raise
        raise Refused(user) from None


def run_job(cfg: DictConfig):
    p = cfg.parallel
    processes = world_size(p)
    relaunch = launched_world_size() == 1 and processes > 1 and not cfg.dry_run  # e.g. parallel=dp2 on one box
    typed = {o.key_or_group for o in OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))}
    for note in inherit(cfg, typed):  # the model's shape and template from stage.init_from's checkpoint
        print(f"[stage] {note}", flush=True)
    validate(cfg, world_size=processes if relaunch else launched_world_size())
    if cfg.dry_run:
        from planner.dry_run import dry_run_report

        print(dry_run_report(cfg, list(HydraConfig.get().overrides.task)))
        return None
    nodes = cfg.nodes or 1
    if relaunch and nodes > 1:
        check_multi_node(cfg, HydraConfig.get().overrides.hydra)
    if launched_world_size() == 1 and cfg.node_rank == 0:  # msrun's workers, and the other nodes, write into the
        check_run_dir(HydraConfig.get().runtime.output_dir)  # directory node 0 checked: a new one or an earlier run's
    if relaunch:
        from distributed.launch import relaunch as launch

        sys.exit(launch(processes, HydraConfig.get().runtime.output_dir, nodes, cfg.node_rank, cfg.master_addr,
                        cfg.master_port))
    from trainer.console import console_to
    from trainer.loop import train  # the training stack loads only when training
    from trainer.metrics import write_status

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    if hydra_cfg.mode == RunMode.MULTIRUN:
        cfg.logger.group = cfg.logger.group or hydra_cfg.sweep.dir  # one group per `-m` invocation
        cfg.logger.run_name = cfg.logger.run_name or swept_values(hydra_cfg)
    cfg.logger.run_name = cfg.logger.run_name or hydra_cfg.job.override_dirname or os.path.basename(run_dir)
    main_rank = launched_rank() == 0
    status = write_status if main_rank else (lambda *args, **kwargs: None)
    with console_to(os.path.join(run_dir, "train.log")) if main_rank else contextlib.nullcontext():
        return _train(cfg, run_dir, main_rank, status, train)


def _train(cfg: DictConfig, run_dir: str, main_rank: bool, status, train):
    """The run itself, its console output kept in train.log (main rank)."""
    if main_rank:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        print(f"run dir: {run_dir}")
    status(run_dir, "running")
    try:
        metrics = train(cfg, run_dir)
    except BaseException as err:  # a user error (bad file, checkpoint, credential) says itself; a bug its type too
        status(run_dir, "failed", error=str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}")
        raise
    status(run_dir, "preempted" if metrics.get("preempted") else "finished", step=metrics.get("step"))
    if launched_world_size() > 1:
        from distributed.launch import mark_done

        mark_done(run_dir, launched_rank())
    return metrics.get("val_loss")


def usage() -> str:
    """`python train.py --help`: the config groups and their presets (conf/, and the objectives, which are their own
    presets), not Hydra's listing, which shows the schemas' internal base_* nodes too."""
    from base.registry import OBJECTIVES

    conf = os.path.join(REPO_ROOT, "conf")
    groups = {g: sorted(f[:-5] for f in os.listdir(os.path.join(conf, g)) if f.endswith(".yaml"))
              for g in sorted(os.listdir(conf)) if os.path.isdir(os.path.join(conf, g)) and g != "recipe"}
    groups["objective"] = sorted(OBJECTIVES)
    lines = ["usage: python train.py [group=preset ...] [key=value ...]   (-m: a sweep; --cfg job: print the config)",
             "", "Config groups (one preset each; conf/<group>/, the objectives in objectives/):"]
    lines += [f"  {group:<10} {', '.join(presets)}" for group, presets in sorted(groups.items())]
    lines += ["", "Any key of the composed config can be set (python train.py --cfg job prints them all), e.g.",
              "  python train.py stage=tiny_pretrain optim.lr=1e-3 trainer.max_steps=2000",
              "  python train.py model=13b parallel=tp8pp2 device=ascend910b dry_run=true",
              "Recipes (several stages in one command): python -m recipe recipe=<name>. Hydra's own help: --hydra-help.",
              "The guide: README.md and docs/."]
    return "\n".join(lines)


@entry_point
def main(argv=None) -> None:
    """`python train.py [overrides]`: Hydra reads sys.argv; `argv` replaces it (tests run this in-process)."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        print(usage())
        return
    if is_scheduler():  # it needs no config: init() as the scheduler serves the workers until they finish
        from mindspore.communication import init

        init()
        return
    with told_to_other_nodes(sys.argv[1:]):  # a node that fails before launching ends the others' launches
        try:
            run()
        except Refused as refused:
            raise refused.error from None


if __name__ == "__main__":
    sys.exit(main())
