"""What a recipe says, read and checked before any stage runs.

conf/recipe/<name>.yaml:

    name: tiny_chat
    metric: dpo/val_rewards/accuracies     # the report marks the variant with the best value: <stage>/<metric>
    goal: max                              # or min
    common: {model: tiny}                  # keys every training stage gets (stage keys win)
    stages:                                # in order
      pretrain: {stage: tiny_pretrain}     # a training stage: a stage preset (default: the entry's name) ...
      sft: {data: instructions, trainer: {max_steps: 100}}   # ... and train.py keys: a string at a group is
      dpo: {data: preferences}                               #     its preset, nested mappings are keys
      evaluate: {kind: evaluate, data: default, tasks: [], prompts: ["Define: apple"]}

A training stage starts from the final checkpoint of the training stage before it whose objective does not train a
side input for later stages (a reward model is one: PPO after SFT and RM starts from SFT's; `init_from: <path>`
instead); what
its objective takes from an earlier stage (its NEEDS: PPO's reward model) comes from the last stage whose objective
PROVIDES it, unless its key is set (`objective: {reward_model: <path>}`); `overrides: [...]` takes
raw train.py overrides for anything the mapping cannot say. An evaluation stage scores the previous training
stage's checkpoint (`of: <stage>` another one) with `python -m evaluation` (`data`, `tasks`, `tasks_dir`: where
their names are looked up, `eval: {key: value}`)
and greedy generations for `prompts` (instructions, wrapped in the checkpoint's own template).
"""
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from base.errors import ConfigError

GROUPS = ("model", "parallel", "data", "objective", "peft", "optim", "precision", "device", "logger")
KINDS = ("train", "evaluate")
TRAIN_KEYS = ("stage", "kind", "init_from", "overrides")
EVALUATE_KEYS = ("kind", "of", "data", "tasks", "tasks_dir", "eval", "prompts", "max_new_tokens", "overrides")


@dataclass
class Stage:
    index: int  # 1-based position in the recipe
    name: str  # the recipe's name for it, e.g. sft
    kind: str  # train | evaluate
    overrides: List[str]  # train.py overrides (train), evaluate's (evaluate)
    source: Optional[str] = None  # the stage whose final checkpoint it starts from (train) or scores (evaluate)
    init_from: Optional[str] = None  # a checkpoint given instead of a source stage
    tasks: Optional[List[str]] = None  # evaluate: task names (None: evaluate's default, every built task)
    tasks_dir: Optional[str] = None  # evaluate: where task names are looked up (None: evaluate's default)
    prompts: List[str] = field(default_factory=list)  # evaluate: instructions to generate answers for
    max_new_tokens: int = 64

    @property
    def dirname(self) -> str:
        return f"{self.index:02d}-{self.name}"


def override_value(value) -> str:
    """A Python value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if text and not any(c in text for c in " ,[]{}()'\"=\\\t\n") or text.startswith("${"):
        return text
    return json.dumps(text).replace("'", "\\'")


class Preset(dict):
    """A group's preset with keys set on top of it: the recipe's common `model: 7b` and a stage's `model:
    {recompute: selective}` are model=7b model.recompute=selective."""

    def __init__(self, name: str, keys: dict):
        super().__init__(keys)
        self.name = name


def flatten(node: dict, prefix: str = "") -> List[str]:
    """train.py overrides of a mapping: a string at a top-level config group is that group's preset (`data:
    instructions` -> data=instructions), nested mappings are keys (`optim: {lr: 1e-4}` -> optim.lr=0.0001)."""
    out = []
    for key, value in node.items():
        if isinstance(value, Preset):
            out += [f"{key}={value.name}"] + flatten(value, f"{prefix}{key}.")
        elif isinstance(value, dict):
            out += flatten(value, f"{prefix}{key}.")
        elif not prefix and key in GROUPS and isinstance(value, str):
            out.append(f"{key}={value}")
        else:
            out.append(f"{prefix}{key}={override_value(value)}")
    return out


def merged(base: dict, over: dict) -> dict:
    """`over` on top of `base`, mappings merged key by key (a stage's keys on top of the recipe's common ones); at
    a top-level group, a preset and keys on either side make both (Preset)."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            out[key] = Preset(old.name, merged(old, value)) if isinstance(old, Preset) else merged(old, value)
        elif key in GROUPS and isinstance(value, str) and isinstance(old, dict) and not isinstance(old, Preset):
            out[key] = Preset(value, old)
        elif key in GROUPS and isinstance(value, dict) and isinstance(old, str):
            out[key] = Preset(old, value)
        else:
            out[key] = value
    return out


def _plain(node):
    return OmegaConf.to_container(node, resolve=False) if isinstance(node, (DictConfig, ListConfig)) else node


def parse(recipe: DictConfig, declared: List[str], stage_presets: List[str]) -> List[Stage]:
    """The recipe's stages, checked for what can be told without composing them: each named in the recipe's own
    file (`declared`: an override naming another stage is refused), a known kind and stage preset, and something
    to start from or to evaluate. ConfigError naming recipe.stages.<stage>[.<key>] otherwise."""
    stages_node: Dict[str, dict] = _plain(recipe.get("stages")) or {}
    common = _plain(recipe.get("common")) or {}
    if not stages_node:
        raise ConfigError("recipe.stages", f"recipe {recipe.get('name')} lists no stages")
    if not isinstance(common, dict):
        raise ConfigError("recipe.common", f"must be a mapping of train.py keys, got {common!r}")
    stages: List[Stage] = []
    last_train: Optional[str] = None
    for index, (name, node) in enumerate(stages_node.items(), 1):
        key = f"recipe.stages.{name}"
        if name not in declared:
            raise ConfigError(key, f"recipe {recipe.get('name')} has no stage {name}; its stages are "
                              f"{', '.join(declared)} (an override must name one of them)")
        node = dict(node or {})
        kind = node.pop("kind", "train")
        if kind not in KINDS:
            raise ConfigError(f"{key}.kind", f"got {kind!r}; choose one of {', '.join(KINDS)}")
        extra = node.pop("overrides", []) or []
        if not isinstance(extra, list):
            raise ConfigError(f"{key}.overrides", f"must be a list of train.py overrides, got {extra!r}")
        if kind == "evaluate":
            unknown = sorted(set(node) - set(EVALUATE_KEYS))
            if unknown:
                raise ConfigError(f"{key}.{unknown[0]}", f"an evaluation stage does not take {unknown[0]}; it takes "
                                  f"{', '.join(EVALUATE_KEYS)}")
            source = node.pop("of", None) or last_train
            if source is None:
                raise ConfigError(key, "an evaluation stage scores a training stage's checkpoint: put one before it")
            if source not in [s.name for s in stages if s.kind == "train"]:
                raise ConfigError(f"{key}.of", f"{source!r} is not a training stage before it")
            overrides = [f"data={node['data']}"] if "data" in node else []
            overrides += [f"eval.{k}={override_value(v)}" for k, v in (node.get("eval") or {}).items()]
            tasks, tasks_dir = node.get("tasks"), node.get("tasks_dir")
            if tasks_dir is not None:  # e.g. ${oc.env:MINDLAB_DATA_DIR,...}/chat_zh/tasks, as the data presets write it
                tasks_dir = str(OmegaConf.create({"dir": tasks_dir}).dir)
            stages.append(Stage(index, name, kind, overrides + [str(o) for o in extra], source=source,
                                tasks=None if tasks is None else [str(t) for t in tasks], tasks_dir=tasks_dir,
                                prompts=[str(p) for p in node.get("prompts") or []],
                                max_new_tokens=int(node.get("max_new_tokens", 64))))
            continue
        preset = node.pop("stage", name)
        if preset not in stage_presets:
            raise ConfigError(f"{key}.stage", f"no stage preset {preset!r} in conf/stage/; choose one of "
                              f"{', '.join(stage_presets)} (or set recipe.stages.{name}.stage)")
        init_from = node.pop("init_from", None)
        overrides = [f"stage={preset}"] + flatten(merged(common, node)) + [str(o) for o in extra]
        stages.append(Stage(index, name, kind, overrides, source=None if init_from else last_train,
                            init_from=init_from))
        last_train = name
    return stages
