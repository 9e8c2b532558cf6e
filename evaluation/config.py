"""What `python -m evaluation CKPT [overrides]` runs with: train.py's composition of the overrides over the
checkpoint's own config, and the `eval.<key>=value` / `tasks=[...]` arguments, which are not train.py keys.

  - `model` is the checkpoint's (CKPT/config.yaml), registered as the preset `model=_checkpoint`, so single
    keys still override it (`model.rope_scaling.factor=4`) but `model=<preset>` is refused. The native Llama
    is built whatever `model.impl` was (the same weights and logits as MindFormers', any sequence length).
  - `data`, `objective`, and `trainer.{micro_batch_size,eval_batches,seed}` default to the checkpoint's too
    (`data=_checkpoint`, ...), so the validation rows, their batches and BERT's validation masks are the ones
    its training evaluated (the `loss` column reproduces metrics.jsonl's val_loss); `data=<preset>` and
    `data.seq_len=512` work as in train.py. A checkpoint that trained on instruction samples or preference
    pairs (SFT, DPO, PPO; a reward model has no LM head to score with) is scored as the language model it is
    (train.py's default objective, clm) on the documents of the run it descends from (stage.init_from, back to its
    pretraining: `documents_of`).
  - the tokenizer is the checkpoint's tokenizer.model: the data's cache is reused as it is when it was built
    with that very file (the training run's own data), else data.tokenizer.path points at a copy of it named
    by its SHA-256 under data.cache_dir/tokenizers/, so every checkpoint of a run shares one prepared cache.
"""
import difflib
import hashlib
import inspect
import os
import re
import shutil
import textwrap
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError
from base.schema import REPO_ROOT

CHECKPOINT_PRESET = "_checkpoint"  # the preset name under which the checkpoint's groups are registered


@dataclass
class EvalConfig:
    """The `eval.<key>=value` arguments."""

    batches: Optional[int] = None  # validation batches per source; None: trainer.eval_batches (training's); 0: all
    context_lengths: List[int] = field(default_factory=list)  # more row lengths for loss by position
    position_bucket: int = 128  # target positions per bucket of loss by position
    data: bool = True  # the per-source evaluation (false: tasks only, no data is prepared)
    max_items: int = 0  # items per task (the first ones); 0: all
    max_new_tokens: int = 64  # generation tasks
    # passkey retrieval (Mohtashami & Jaggi 2023): a 5-digit key hidden in a prompt of each length, scored by
    # the log-likelihood of the key against 9 other keys
    passkey_lengths: List[int] = field(default_factory=list)  # prompt lengths (tokens); []: no passkey
    passkey_depths: List[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])  # share of the filler before the key
    passkey_trials: int = 10  # keys per (length, depth); chance is 1/10


def eval_keys_help() -> str:
    """The eval.<key> lines of --help: each EvalConfig field, its default and its comments (read from the source
    above, so the two never disagree)."""
    defaults = OmegaConf.to_container(OmegaConf.structured(EvalConfig))
    lines, block = [], []
    for text in (line.strip() for line in inspect.getsource(EvalConfig).splitlines()):
        if text.startswith("#"):
            block.append(text.lstrip("# "))
            continue
        match = re.match(r"(\w+): [^=]+=.*?(?:#\s*(.*))?$", text)
        if match and match.group(1) in defaults:
            key = f"  eval.{match.group(1)}={defaults[match.group(1)]}"
            about = textwrap.wrap(": ".join(filter(None, [" ".join(block), match.group(2)])), 80)
            if len(key) >= 34:  # the comment goes on the next line
                lines.append(key)
                key = ""
            lines += [key.ljust(34) + line for line in about[:1]] + [" " * 34 + line for line in about[1:]]
        block = []
    return "\n".join(lines)


def split_arguments(overrides: Sequence[str]) -> Tuple[EvalConfig, Optional[List[str]], List[str]]:
    """(eval config, task names or None when not given, the overrides left for Hydra)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    values, tasks, rest = {}, None, []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as err:
            raise ConfigError(text.split("=")[0], f"cannot parse {text!r}: {err}") from None
        key = override.key_or_group
        if key == "tasks":
            value = override.value()
            tasks = [str(v) for v in value] if isinstance(value, list) else [str(value)]
        elif key.startswith("eval."):
            values[key[len("eval."):]] = override.value()
        else:
            rest.append(text)
    known = [f.name for f in fields(EvalConfig)]
    for key in values:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(f"eval.{key}", "unknown key" + (f"; did you mean eval.{hint[0]}?" if hint else
                                                               f"; known keys: eval.{', eval.'.join(known)}"))
    try:
        eval_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalConfig), values))
    except Exception as err:  # omegaconf ValidationError: a wrongly typed value
        raise ConfigError(f"eval.{getattr(err, 'key', '') or ''}".rstrip("."), str(err).splitlines()[0]) from None
    if eval_cfg.position_bucket < 1:
        raise ConfigError("eval.position_bucket", f"must be >= 1, got {eval_cfg.position_bucket}")
    if eval_cfg.batches is not None and eval_cfg.batches < 0:
        raise ConfigError("eval.batches", f"must be >= 0 (0: all validation rows), got {eval_cfg.batches}")
    return eval_cfg, tasks, rest


def _sample_data(data) -> bool:
    from base.registry import FORMATS

    return any(s.kind in FORMATS for s in data.sources)


def documents_of(saved: DictConfig, saved_file: str) -> DictConfig:
    """The documents a checkpoint is evaluated on by default: its own data, or, for one that trained on instruction
    samples or preference pairs (SFT, RM, DPO, PPO), the data of the checkpoint it started from, and so on back to
    the pretraining run it descends from (stage.init_from)."""
    from base import checkpoint

    config, where = saved, saved_file
    for _ in range(16):
        if "data" not in config:
            raise ConfigError("data", f"{where} names no data (a converted model?); give one, e.g. data=default")
        if not _sample_data(config.data):
            return config.data
        start = OmegaConf.select(config, "stage.init_from")
        path = os.path.join(checkpoint.resolve(start), "config.yaml") if start and os.path.exists(start) else None
        if path is None or not os.path.isfile(path):
            raise ConfigError("data", f"{saved_file} trained on samples (data={saved.data.name}) and the checkpoint it "
                              f"started from ({start}) is not there to say which documents it knows; give them, e.g. "
                              "data=default or data=corpora_5dom")
        config, where = OmegaConf.load(path), path
    raise ConfigError("data", f"{saved_file}: no pretraining data found along its stage.init_from chain; give data=")


def compose_config(ckpt: str, overrides: Sequence[str]) -> DictConfig:
    """train.py's composition of `overrides` over the checkpoint's model (and, unless overridden, its data,
    objective and validation batching), validated; data.tokenizer set to the checkpoint's tokenizer."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from base.registry import FAMILIES, OBJECTIVES
    from base.schema import DataConfig
    from base.validate import validate

    saved_file = os.path.join(ckpt, "config.yaml")
    if not os.path.isfile(saved_file):
        raise ConfigError("checkpoint", f"{saved_file}: not found; CKPT must be a checkpoint directory "
                          "(outputs/<date>/<time>/checkpoints/step_NNNNNN)")
    saved = OmegaConf.load(saved_file)
    trained = OmegaConf.select(saved, "objective.name")
    provides = getattr(OBJECTIVES[trained], "PROVIDES", None) if trained in OBJECTIVES else None
    if provides:  # e.g. a reward model: a scalar head on the decoder, no LM head to score text with
        raise ConfigError("checkpoint", f"{ckpt} is a {provides.replace('_', ' ')} (objective={trained}), not a language "
                          f"model; evaluate the model trained with it, or read its held-out numbers (val_*) in its "
                          "run's metrics.jsonl")
    given = {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}
    if "model" in given:
        raise ConfigError("model", f"comes from the checkpoint ({saved_file}); override single keys instead, "
                          "e.g. model.rope_scaling.type=linear")
    store = ConfigStore.instance()
    model_node = OmegaConf.merge(OmegaConf.structured(FAMILIES[saved.model.family].Config), saved.model)
    if "impl" in model_node:
        model_node.impl = "native"  # MindFormers' Llama has the same weights and logits, at one fixed length
    model_node.recompute = "none"
    store.store(group="model", name=CHECKPOINT_PRESET, node=model_node)
    head = [f"model={CHECKPOINT_PRESET}"]
    if "data" not in given:
        data = documents_of(saved, saved_file)
        store.store(group="data", name=CHECKPOINT_PRESET, node=OmegaConf.merge(OmegaConf.structured(DataConfig), data))
        head.append(f"data={CHECKPOINT_PRESET}")
    # the objective it trained with on documents (its rows, BERT's validation masks); one that trained on samples
    # or pairs leaves train.py's default, a language model of documents
    if "objective" not in given and "objective" in saved and "data" in saved and not _sample_data(saved.data):
        plugin = OBJECTIVES[saved.objective.name]
        store.store(group="objective", name=CHECKPOINT_PRESET,
                    node=OmegaConf.merge(OmegaConf.structured(plugin.Config), saved.objective))
        head.append(f"objective={CHECKPOINT_PRESET}")
    for key in ("micro_batch_size", "eval_batches", "seed"):
        if f"trainer.{key}" not in given and key in saved.get("trainer", {}):
            head.append(f"trainer.{key}={saved.trainer[key]}")
    with initialize_config_dir(config_dir=os.path.join(REPO_ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=head + list(overrides))
    if "data.sources" in given and not {"data", "data.name"} & given:  # sources typed: not the preset's name
        cfg.data.name = "command-line sources " + ", ".join(s.name for s in cfg.data.sources)
    cfg.data.tokenizer.path = checkpoint_tokenizer(cfg.data, ckpt)
    validate(cfg)
    return cfg


def checkpoint_tokenizer(data_cfg, ckpt: str) -> str:
    """The data.tokenizer.path that makes `data_cfg` use the checkpoint's tokenizer.model: the one it has when
    that file, or the cache it names, holds the same bytes (so that cache is reused: no re-tokenizing), else a
    copy of it at <cache_dir>/tokenizers/<sha256[:16]>.model (stable path and mtime: one cache per tokenizer)."""
    from data.cache import cache_key

    tokenizer_file = os.path.join(ckpt, "tokenizer.model")
    if not os.path.isfile(tokenizer_file):
        raise ConfigError("checkpoint", f"{tokenizer_file}: not found; the checkpoint has no tokenizer")
    content = Path(tokenizer_file).read_bytes()
    path = data_cfg.tokenizer.path
    if path:
        if os.path.isfile(path) and Path(path).read_bytes() == content:
            return path
    else:
        built = Path(data_cfg.cache_dir) / cache_key(data_cfg) / "tokenizer.model"
        if built.is_file() and built.read_bytes() == content:
            return None
    copy = Path(data_cfg.cache_dir) / "tokenizers" / f"{hashlib.sha256(content).hexdigest()[:16]}.model"
    if not copy.is_file():
        copy.parent.mkdir(parents=True, exist_ok=True)
        tmp = copy.with_name(f"{copy.name}.tmp-{os.getpid()}")
        shutil.copyfile(tokenizer_file, tmp)
        os.replace(tmp, copy)
    return str(copy)
