"""Run a recipe's stages into one directory, each stage once.

`plan` composes every training stage's train.py config up front (conf/, the typed schema, base/validate.py
with dry_run=true), so a stage that cannot run is refused before anything runs, naming the stage; each stage
gets a key, the hash of its composed config (unresolved: `${tokenizer_of:...}` and environment variables stay as
written), which includes the path of the stage it starts from and so that stage's key. Stages live under
<root>/stages/<name>-<key>/ (root: the multirun's sweep directory, or the run directory), and each variant's
<run>/<nn>-<name> links there: a stage that an earlier variant already finished is not run again.

`run` runs what is not finished: a training stage is `python train.py <overrides> hydra.run.dir=<stage dir>`
(a rerun resumes it from its latest checkpoint, trainer.resume=auto), an evaluation stage `python -m evaluation`
and `python -m generate` on the checkpoint it scores. A stage directory is locked while it runs (variants of a
parallel sweep wait for each other's shared stage). A recipe directory run again with another config for one of
its stages is refused, naming the stage: nothing computed is replaced.
"""
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

from omegaconf import DictConfig, OmegaConf

from base.checkpoint import resolve
from base.errors import ConfigError, UserError
from base.outputs import HYDRA_WRITES, MARKER, file_lock
from base.paths import REPO_ROOT, data_dir
from base.registry import OBJECTIVES
from base.validate import validate
from recipe.report import CURVES, RECORD, REPORT
from recipe.spec import Stage, override_value

STORE = "stages"


class StageFailed(UserError):
    """A stage's command exited non-zero (its own error is above it in the output); rerunning resumes it."""


@dataclass
class Planned:
    stage: Stage
    key: str
    dir: Path  # <root>/stages/<name>-<key>
    args: List[str]  # the command: train.py's overrides, or evaluate's arguments after the checkpoint
    config: Optional[DictConfig] = None  # a training stage's composed config
    source: Optional["Planned"] = None  # the stage it starts from (train) or scores (evaluate)


def compose_train(overrides: List[str]) -> DictConfig:
    """train.py's config for `overrides`, composed here (inside the recipe's own Hydra app: its state is kept)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    finally:
        restore_gh_from_backup(backup)


def config_key(cfg: DictConfig) -> str:
    """The hash of what shapes a training stage's result: its config as composed, less where files are kept and
    how it is logged."""
    config = OmegaConf.to_container(cfg, resolve=False)
    for group, keys in (("logger", None), ("data", ("cache_dir",)), ("trainer", ("compile_cache", "compile_cache_dir"))):
        if keys is None:
            config.pop(group, None)
        else:
            for key in keys:
                config.get(group, {}).pop(key, None)
    config.pop("dry_run", None)
    return _digest(config)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _stage_error(stage: Stage, err: Exception) -> ConfigError:
    return ConfigError(f"recipe.stages.{stage.name}", f"{err} (in the stage's composed train.py config)")


def plan(stages: List[Stage], root: Path, compose: Callable[[List[str]], DictConfig] = compose_train) -> List[Planned]:
    """Every stage composed, validated and keyed, in order (see the module docstring)."""
    done: List[Planned] = []
    by_name = {}
    line: Optional[Planned] = None  # the stage the next training stage starts from: not one providing a side input
    for stage in stages:
        if stage.kind == "evaluate":
            target = by_name[stage.source]
            key = _digest([target.key, stage.overrides, stage.tasks, stage.prompts, stage.max_new_tokens]
                          + ([stage.tasks_dir] if stage.tasks_dir else []))  # (the keys of runs before it stay)
            planned = Planned(stage, key, root / STORE / f"{stage.name}-{key}", list(stage.overrides), source=target)
        else:
            overrides = list(stage.overrides)
            source = line if stage.source else None
            start = stage.init_from or (str(source.dir) if source else None)
            if start and not any(o.startswith("stage.init_from=") for o in overrides):
                overrides.append(f"stage.init_from={override_value(start)}")
            try:
                cfg = compose(overrides)
                needs = OBJECTIVES[cfg.objective.name].NEEDS or {}
                missing = {what: key for what, key in needs.items() if not any(o.startswith(f"{key}=") for o in overrides)}
                for what, key in missing.items():  # e.g. PPO's reward model: the last stage that trained one
                    given = [p for p in done if p.config is not None and
                             OBJECTIVES[p.config.objective.name].PROVIDES == what]
                    if not given:
                        raise ConfigError(f"recipe.stages.{stage.name}", f"objective={cfg.objective.name} takes a "
                                          f"{what} from an earlier stage: put a stage that trains one before it, or "
                                          f"set recipe.stages.{stage.name}.{key}=<checkpoint>")
                    overrides.append(f"{key}={override_value(str(given[-1].dir))}")
                if missing:
                    cfg = compose(overrides)
                validate(OmegaConf.merge(cfg, {"dry_run": True}))  # (files that later stages write: not yet there)
                if cfg.stage.needs_init and not start and not cfg.stage.allow_random_init:
                    raise ConfigError(f"recipe.stages.{stage.name}", f"stage={cfg.stage.name} continues a trained "
                                      "model: put a training stage before it, or set its init_from")
            except ConfigError as err:
                raise err if err.key.startswith("recipe.") else _stage_error(stage, err) from None
            except Exception as err:  # Hydra's composition errors: an unknown preset or key
                raise _stage_error(stage, _one_line(err)) from None
            key = config_key(cfg)
            planned = Planned(stage, key, root / STORE / f"{stage.name}-{key}", overrides, cfg, source)
            if OBJECTIVES[cfg.objective.name].PROVIDES is None:  # (a reward model is a side branch)
                line = planned
        done.append(planned)
        by_name[stage.name] = planned
    return done


def _one_line(err: Exception) -> str:
    from base.errors import hydra_message

    return hydra_message(err)


def check_recipe_dir(job_dir: Path) -> None:
    """A recipe writes into a new directory or an earlier run of a recipe (its recipe.json, stage links, stages/,
    report; Hydra's .hydra and log); a directory holding anything else is refused, naming it."""
    if not job_dir.is_dir():
        return
    ours = {RECORD, STORE, REPORT, CURVES, MARKER, *HYDRA_WRITES}
    foreign = sorted(n for n in os.listdir(job_dir) if n not in ours and not n.endswith(".log")
                     and not (os.path.islink(job_dir / n) and n[:2].isdigit()))
    if foreign:
        raise ConfigError("hydra.run.dir", f"{job_dir} holds files that are not a recipe run's (e.g. {foreign[0]}); "
                          "give a new directory, e.g. hydra.run.dir=recipes/my_chain")


def check_links(planned: List[Planned], job_dir: Path) -> None:
    """A recipe directory holds one variant: a stage link that points at another key (the stage's config changed
    since) is refused before anything runs."""
    for p in planned:
        link = job_dir / p.stage.dirname
        if link.is_symlink() and Path(os.readlink(link)).name != p.dir.name:
            raise ConfigError(f"recipe.stages.{p.stage.name}", f"{job_dir} already ran this stage with another "
                              f"config ({link} -> {os.readlink(link)}); run the changed recipe in a new directory "
                              "(hydra.run.dir=...) or sweep it with -m: nothing computed is replaced")
        if link.exists() and not link.is_symlink():
            raise ConfigError("hydra.run.dir", f"{link} exists and is not a stage link; give a new directory")


def finished(p: Planned) -> bool:
    if p.stage.kind == "evaluate":
        return (p.dir / "eval.json").is_file()
    try:
        status = json.loads((p.dir / "status.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return status.get("status") == "finished" and (p.dir / "checkpoints" / "latest").is_file()


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the recipe process dies (Linux), so a killed recipe leaves no
    stage running on its own."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def execute(command: List[str], log_file: Path, stream) -> int:
    """Run `command` from the repository root, its output shown and kept in `log_file`."""
    with open(log_file, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=_die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            log.write(line)
            stream.write(line)
        return proc.wait()


def stage_commands(p: Planned, workdir: Path, variant: str) -> List[List[str]]:
    """The commands that compute stage `p` into `workdir`; a training stage's W&B run (logger=wandb) is grouped
    by the recipe's `variant`, its job type the stage's name."""
    python = sys.executable
    if p.stage.kind == "train":
        logger = [f"logger.group={override_value(variant)}", f"logger.job_type={p.stage.name}"]
        return [[python, str(REPO_ROOT / "train.py"), *p.args, *logger, f"hydra.run.dir={workdir}"]]
    ckpt = resolve(str(p.source.dir))
    tasks = [] if p.stage.tasks is None else [f"tasks={override_value(p.stage.tasks)}"]
    tasks += ["--tasks-dir", p.stage.tasks_dir] if p.stage.tasks_dir else []
    commands = [[python, "-m", "evaluation", ckpt, *p.args, *tasks, "--out", str(workdir / "eval.json.tmp")]]
    if p.stage.prompts:
        prompts = workdir / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"instruction": t}) + "\n" for t in p.stage.prompts), encoding="utf-8")
        commands.append([python, "-m", "generate", ckpt, "--prompts-file", str(prompts), "--temperature", "0", "--max-new-tokens", str(p.stage.max_new_tokens),
                         "--out", str(workdir / "samples.jsonl")])
    return commands


# datasets a recipe may ask for: name (also the directory the builder writes under the data dir, base/paths.py) ->
# the builder's command
DATASETS = {"instructions": ["-m", "builders.instructions"],
            "preferences": ["-m", "builders.preferences"],
            "tasks": ["-m", "builders.tasks", "build"],
            "chat_zh": ["-m", "builders.chat_zh"]}
# what a dataset's directory must hold besides itself: a directory built before its builder wrote this is built again
NEEDED = {"chat_zh": "tasks"}


def build_datasets(names: List[str], stream=sys.stdout) -> None:
    """Build each dataset the recipe names whose directory (or what NEEDED names in it) is not there yet
    (builders/), in order."""
    root = data_dir()
    for name in names:
        if name not in DATASETS:
            raise ConfigError("recipe.datasets", f"no builder for {name!r}; choose from {', '.join(DATASETS)}")
        if (root / name / NEEDED.get(name, "")).exists():
            continue
        print(f"[recipe] building {name}: python {' '.join(DATASETS[name])}", file=stream, flush=True)
        root.mkdir(parents=True, exist_ok=True)
        code = execute([sys.executable, *DATASETS[name]], root / f"{name}.build.log", stream)
        if code != 0:
            raise StageFailed(f"building {name} failed (exit {code}; its log: {root / f'{name}.build.log'})")


def dry_run_report(planned: List[Planned]) -> str:
    """Each stage's plan: a training stage's dry-run report (layout, memory, time), an evaluation's command."""
    from planner.dry_run import dry_run_report as train_report

    parts = []
    for p in planned:
        head = f"=== stage {p.stage.dirname} ({p.stage.kind}) -> {p.dir}"
        if p.config is None:
            parts.append(f"{head}\n  python -m evaluation <{p.source.stage.name}'s checkpoint> {' '.join(p.args)}")
        else:
            parts.append(f"{head}\n  python train.py {' '.join(p.args)}\n\n" +
                         train_report(OmegaConf.merge(p.config, {"dry_run": True})))
    return "\n\n".join(parts)


def run(planned: List[Planned], job_dir: Path, variant: str, stream=sys.stdout) -> List[dict]:
    """Run the stages that are not finished, in order; returns what recipe.json records about each."""
    check_links(planned, job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for p in planned:
        p.dir.mkdir(parents=True, exist_ok=True)
        link = job_dir / p.stage.dirname
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(p.dir, job_dir))
        start = time.time()
        with file_lock(p.dir.parent / f"{p.dir.name}.lock"):  # a variant running the same stage finishes it first
            state = "reused" if finished(p) else "ran"
            if state == "ran":
                print(f"[recipe] stage {p.stage.dirname}: {p.stage.kind} -> {p.dir}", file=stream, flush=True)
                log = p.dir.parent / f"{p.dir.name}.log"  # beside the stage's directory, which is train.py's own
                for command in stage_commands(p, p.dir, variant):
                    code = execute(command, log, stream)
                    if code != 0:
                        raise StageFailed(f"stage {p.stage.name} failed (exit {code}; its log: {log}); "
                                          "fix what it says and run the same command again: finished stages are kept "
                                          "and this one resumes")
                if p.stage.kind == "evaluate":
                    os.replace(p.dir / "eval.json.tmp", p.dir / "eval.json")
            else:
                print(f"[recipe] stage {p.stage.dirname}: finished already ({p.dir})", file=stream, flush=True)
        records.append({"name": p.stage.name, "kind": p.stage.kind, "key": p.key, "dir": str(p.dir),
                        "link": p.stage.dirname, "source": p.stage.source, "state": state,
                        "seconds": round(time.time() - start, 1)})
    return records
