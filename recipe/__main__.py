"""`python -m recipe recipe=<name> [recipe.stages.<stage>.<key>=<value> ...] [-m ...]`: run a recipe (recipe/).

The recipe's stages go into the run directory (hydra.run.dir, default recipes/<date>/<time>/): <nn>-<stage>/
links, recipe.json and report.html. With -m, every variant is a job directory of the sweep, the stages they share
are computed once, and the sweep directory gets report.html comparing the variants at the end.
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import json
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError, entry_point
from base.paths import REPO_ROOT
from plugins import register
from recipe.runner import build_datasets, check_links, check_recipe_dir, dry_run_report, plan, run
from recipe.spec import parse
from sweeps import recipe_report as report

RECIPES = REPO_ROOT / "conf" / "recipe"


def _register() -> None:
    """train.py's schema (each stage's config is composed with it) and the recipe app's own nodes. A recipe's
    `common` and `stages` stay open: `recipe.stages.sft.optim.lr=3e-4` adds a key the recipe file does not set."""
    register()
    cs = ConfigStore.instance()
    base = OmegaConf.create({"name": "???", "metric": None, "goal": "max", "datasets": [], "common": {}, "stages": {}})
    for node in (base, base.common, base.stages):
        OmegaConf.set_struct(node, False)
    cs.store(group="recipe", name="base_recipe", node=base)
    cs.store(name="recipe_app", node=OmegaConf.create({
        "defaults": [{"recipe": "???"}, "_self_"],
        "dry_run": False,  # plan every stage (train.py's dry run for the training ones) and run nothing
        # a variant is named by its own overrides, not the recipe all of them share
        "hydra": {"job": {"chdir": False, "config": {"override_dirname": {"exclude_keys": ["recipe"]}}},
                  "run": {"dir": "recipes/${now:%Y-%m-%d}/${now:%H-%M-%S}"},
                  "sweep": {"dir": "recipes/multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}", "subdir": "${hydra.job.num}"},
                  "callbacks": {"report": {"_target_": "recipe.report.SweepReport"}}}}))


_register()


@hydra.main(version_base="1.3", config_path=str(REPO_ROOT / "conf"), config_name="recipe_app")
def app(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    name = hc.runtime.choices["recipe"]
    job_dir = Path(hc.runtime.output_dir)
    root = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else job_dir
    declared = list((OmegaConf.load(RECIPES / f"{name}.yaml").get("stages") or {}).keys())
    presets = sorted(p.stem for p in (REPO_ROOT / "conf" / "stage").glob("*.yaml"))
    stages = parse(cfg.recipe, declared, presets)
    planned = plan(stages, root)
    if cfg.dry_run:
        print(dry_run_report(planned))
        return
    check_recipe_dir(job_dir)  # a new directory or an earlier recipe run's, nothing else
    check_links(planned, job_dir)  # a changed stage in this directory is refused before anything is built
    build_datasets(list(cfg.recipe.datasets))
    variant = hc.job.override_dirname or job_dir.name
    record = {"recipe": name, "variant": variant, "overrides": list(hc.overrides.task), "metric": cfg.recipe.metric,
              "goal": cfg.recipe.goal, "stages": []}
    try:
        record["stages"] = run(planned, job_dir, variant)
    finally:
        (job_dir / report.RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")
    print(f"[recipe] report: {report.write(job_dir)}")


@entry_point
def main(argv=None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if not any(a.startswith(("recipe=", "--")) for a in sys.argv[1:]):
        choices = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
        raise ConfigError("recipe", f"name a recipe: python -m recipe recipe=<name>, one of {choices}")
    app()


if __name__ == "__main__":
    sys.exit(main())
