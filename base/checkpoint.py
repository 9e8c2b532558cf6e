"""Checkpoints a run resumes from exactly.

    <run_dir>/checkpoints/
        step_000400/  model.safetensors      network weights (MindFormers names, 1:1 with Hugging Face's)
                      optimizer.safetensors  the optimizer's moments and update count (drives the LR schedule
                                             and AdamW's bias correction)
                      state.json             step, tokens, loss scale, data position, RNG states, run id, optimizer
                                             (optim.name), file sizes
                      config.yaml            the run's resolved config
                      tokenizer.model        the sentencepiece model (so a checkpoint converts on its own)
        latest        name of the newest complete checkpoint, replaced last

A checkpoint argument (stage.init_from, trainer.resume, every CLI's CKPT) may name the step directory, `latest`,
the run's checkpoints/ or the run directory itself (`resolve`). state.json records the tokenizer's SHA-256, so a
stage can check that the checkpoints and data it pairs speak the same tokenizer.

Writing goes to `step_N.tmp-<pid>`, fsyncs every file, renames the directory into place and only then
replaces `latest`: a crash at any moment leaves the previous checkpoint intact and nothing that looks
complete but is not; a full disk removes the partial directory and says so in one line (base/errors.py
`writing`). Resuming takes the newest checkpoint whose files have the sizes state.json recorded; a damaged one is
reported and the one before it is used (a file of the right size that does not load is one CheckpointError).

MindSpore is imported only by the functions that read or write tensors, so resolving paths and reading state is
cheap (the config layer's `${tokenizer_of:...}` does it).
"""
import hashlib
import json
import os
import shutil
from typing import Dict, List, Optional, Set

from omegaconf import DictConfig, OmegaConf

from base.errors import CheckpointError, writing

__all__ = ["CheckpointError", "load", "load_weights", "resolve", "save"]
WEIGHTS, OPTIMIZER, STATE, CONFIG, TOKENIZER, LATEST = "model.safetensors", "optimizer.safetensors", \
    "state.json", "config.yaml", "tokenizer.model", "latest"
CHECKPOINTS = "checkpoints"  # a run directory's checkpoint root
ADAPTERS = "adapter_config.json"  # beside a LoRA run's weights, which are its adapters only (PEFT's config)


def resolve(path: str) -> str:
    """The step directory a checkpoint argument means: `path` itself when it is a step directory or a file, else
    what `latest` names in the run directory, its checkpoints/, or the `latest` file given. A `latest` naming a
    directory that is gone (deleted, pruned) is refused naming it and the newest intact checkpoint left."""
    if os.path.basename(path) == LATEST and os.path.isfile(path):
        root = os.path.dirname(path)
    elif os.path.isfile(os.path.join(path, CHECKPOINTS, LATEST)):
        root = os.path.join(path, CHECKPOINTS)
    elif os.path.isfile(os.path.join(path, LATEST)):
        root = path
    else:
        return path
    with open(os.path.join(root, LATEST), encoding="utf-8") as f:
        name = f.read().strip()
    target = os.path.join(root, name)
    if os.path.isdir(target):
        return target
    intact = latest_intact(root, log=lambda *_: None)
    raise CheckpointError(f"{os.path.join(root, LATEST)}: points at {name}, which is gone (deleted or pruned); " + (
        f"the newest intact checkpoint is {intact}: give that one (trainer.resume=auto resumes from it)" if intact
        else f"no intact checkpoint is left in {root}"))


def tokenizer_of(path: str) -> Optional[str]:
    """A checkpoint's tokenizer.model (any form `resolve` takes), or None when it has none."""
    path = resolve(path)
    directory = os.path.dirname(path) if path.endswith(".safetensors") else path
    file = os.path.join(directory, TOKENIZER)
    return file if os.path.isfile(file) else None


# the model keys that say what the weights are (their shapes, and what they were trained at), which a stage started
# from a checkpoint takes from it; the others say how to compute (kernels, recompute) and stay the run's
SHAPE = ("name", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
         "tie_embeddings", "max_position_embeddings", "rope_theta", "norm_eps",
         # a mixture of experts' (models/moe): its experts and how a token is routed to them; how many tokens an
         # expert takes and the router's losses (capacity_factor, aux_loss_coef, z_loss_coef) stay the run's
         "num_experts", "top_k", "expert_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size",
         "shared_expert_gate")


def inherit(cfg: DictConfig, typed: Set[str]) -> List[str]:
    """What a stage started from a checkpoint (stage.init_from) takes from the checkpoint's config.yaml, in place:
    the model's shape (SHAPE, where the family is the same) unless the command line set the key (`typed`: the
    keys of its overrides), and the template its samples were rendered with when data.template is unset. Returns
    one note per key taken or kept against the checkpoint's, for the run's log."""
    if not cfg.stage.init_from:
        return []
    path = resolve(cfg.stage.init_from)
    file = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), CONFIG)
    if not os.path.isfile(file):
        return []
    saved, notes = OmegaConf.load(file), []
    if OmegaConf.select(saved, "model.family") == cfg.model.family:
        for key in SHAPE:
            theirs = OmegaConf.select(saved, f"model.{key}")
            if theirs is None or key not in cfg.model or theirs == cfg.model[key]:
                continue
            if f"model.{key}" in typed:
                notes.append(f"model.{key}={cfg.model[key]} as typed; the checkpoint's is {theirs}")
            else:
                notes.append(f"model.{key}={theirs} from the checkpoint (the preset says {cfg.model[key]})")
                cfg.model[key] = theirs
    tuned, mine = OmegaConf.select(saved, "data.template") or {}, cfg.data.template
    if not any(v is not None for v in tuned.values()):  # a pretrained model: no template learned
        return notes
    if all(v is None for v in mine.values()):
        for key, value in tuned.items():
            mine[key] = value
        notes.append(f"data.template: the checkpoint's ({tuned.get('name') or 'custom parts'})")
    elif OmegaConf.to_container(mine) != OmegaConf.to_container(tuned):
        notes.append(f"data.template: {mine.get('name') or 'custom parts'} as set, not the checkpoint's "
                     f"({tuned.get('name') or 'custom parts'})")
    return notes


def check_same_tokenizer(key: str, first: str, first_tokenizer: Optional[str], second: str,
                         second_tokenizer: Optional[str]) -> None:
    """Refuse (ConfigError on `key`, naming both sides) two models, or a model and its data, whose tokenizer.model
    files differ: the same ids would mean other pieces to each (a vocabulary of the same size is not enough).
    Nothing is checked where a side has no tokenizer file."""
    from base.errors import ConfigError

    if not (first_tokenizer and second_tokenizer):
        return
    a, b = tokenizer_digest(first_tokenizer), tokenizer_digest(second_tokenizer)
    if a != b:
        raise ConfigError(key, f"{first} and {second} use different tokenizers ({first_tokenizer}: sha256 {a[:12]}; "
                          f"{second_tokenizer}: sha256 {b[:12]}): the same token ids would mean different text to "
                          "each; pair models (and data) that share one tokenizer.model")


def tokenizer_digest(path: str) -> str:
    """SHA-256 of a tokenizer.model file: what two models or a model and its data must share to understand each
    other (recorded in every checkpoint's state.json)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str, step: int, model, optimizer, state: dict, cfg: DictConfig, tokenizer_file: Optional[str] = None,
         only: Optional[Set[str]] = None, extra_files: Optional[Dict[str, dict]] = None) -> str:
    """`only`: the model weights to write (a LoRA run: its adapters; the frozen base stays at stage.init_from);
    `extra_files`: JSON files to write beside them (a LoRA run's PEFT adapter_config.json)."""
    import mindspore as ms

    final = os.path.join(root, f"step_{step:06d}")
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weights = model.parameters_dict()
    saved = [p for name, p in weights.items() if only is None or name in only] + \
        [p for name, p in optimizer.parameters_dict().items() if name not in weights]
    needed = sum(p.size * p.itemsize for p in saved)
    intact = latest_intact(root, log=lambda *_: None)
    kept = f"the earlier checkpoints are intact (latest: {os.path.basename(intact)})" if intact else \
        "no checkpoint of this run was written yet"
    with writing(tmp, needed, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True), kept=kept):
        ms.save_checkpoint(model, os.path.join(tmp, WEIGHTS), format="safetensors",
                           choice_func=None if only is None else lambda name: name in only)
        ms.save_checkpoint(optimizer, os.path.join(tmp, OPTIMIZER), format="safetensors",
                           choice_func=lambda name: name not in weights)
        for name, content in (extra_files or {}).items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2)
        write_metadata(tmp, step, state, cfg, tokenizer_file)
    shutil.rmtree(final, ignore_errors=True)  # a same-step leftover of a run that crashed after the rename
    os.replace(tmp, final)
    _fsync(root)
    set_latest(root, final)
    return final


def write_metadata(directory: str, step: int, state: dict, cfg: DictConfig, tokenizer_file: Optional[str]) -> None:
    """config.yaml, tokenizer.model and, last, state.json with the sizes of the files written so far."""
    OmegaConf.save(cfg, os.path.join(directory, CONFIG), resolve=True)
    if tokenizer_file:
        shutil.copy(tokenizer_file, os.path.join(directory, TOKENIZER))
        state = {**state, "tokenizer_sha256": tokenizer_digest(tokenizer_file)}
    for name in write_state(directory, {"step": step, **state}):
        _fsync(os.path.join(directory, name))
    _fsync(os.path.join(directory, STATE))


def write_state(directory: str, state: dict) -> List[str]:
    """state.json with the sizes of the files beside it (read_state checks them); returns those files."""
    sizes = {name: os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
             if name != STATE and os.path.isfile(os.path.join(directory, name))}
    with open(os.path.join(directory, STATE), "w", encoding="utf-8") as f:
        json.dump({**state, "file_sizes": sizes}, f, indent=1)
    return list(sizes)


def set_latest(root: str, final: str) -> None:
    """Point `latest` at checkpoint directory `final` (atomic rename)."""
    latest_tmp = os.path.join(root, f"{LATEST}.tmp-{os.getpid()}")
    with open(latest_tmp, "w", encoding="utf-8") as f:
        f.write(os.path.basename(final) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, LATEST))
    _fsync(root)


def complete_checkpoints(root: str) -> List[str]:
    """Checkpoint directories under `root`, oldest first (temporary and foreign entries skipped)."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith("step_") and ".tmp" not in n and n[5:].isdigit()]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[5:]))]  # step_1000000 after step_999999


def prune(root: str, keep_last: int, keep_every: int) -> None:
    """Delete all but the newest `keep_last` checkpoints and every step divisible by `keep_every`."""
    done = complete_checkpoints(root)
    for path in done[:-keep_last] if keep_last > 0 else []:
        step = int(os.path.basename(path)[len("step_"):])
        if not (keep_every and step % keep_every == 0):
            shutil.rmtree(path)
    for name in os.listdir(root):  # temporary directories of crashed saves
        if ".tmp-" in name and name.startswith("step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_state(path: str) -> dict:
    """state.json of a checkpoint, after checking that its files are all there at their recorded sizes."""
    state_file = os.path.join(path, STATE)
    try:
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{state_file}: unreadable ({err})") from None
    for name, size in state.get("file_sizes", {}).items():
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.exists(file) else None
        if actual != size:
            raise CheckpointError(f"{file}: {'missing' if actual is None else f'{actual} bytes'}, "
                                  f"the checkpoint recorded {size}: it is truncated or damaged")
    return state


def latest_intact(root: str, log=print) -> Optional[str]:
    """The newest checkpoint that passes read_state; damaged ones are reported and skipped."""
    for path in reversed(complete_checkpoints(root)):
        try:
            read_state(path)
            return path
        except CheckpointError as err:
            log(f"[checkpoint] skipping damaged checkpoint: {err}")
    return None


def check_optimizer(path: str, name: str) -> None:
    """Refuse to resume optimizer state written by another optimizer preset: its update rule (and for some its
    tensors) differ, so the run would not continue as it was. Checkpoints written before state.json recorded
    the optimizer are nn.AdamWeightDecay's, which optim=adamw_bert is."""
    state = read_state(path)
    saved = state.get("optimizer", "adamw_bert")
    if saved != name:
        old = "" if "optimizer" in state else " (written before checkpoints named their optimizer, by MindSpore's " \
            "AdamWeightDecay: optim=adamw_bert)"
        raise CheckpointError(f"{os.path.join(path, STATE)}: its optimizer state is optim={saved}'s{old} but this run "
                              f"uses optim={name}; resume with optim={saved} to continue it exactly, or start from its "
                              f"weights with a fresh optimizer: stage.init_from={path} trainer.resume=none")


def _load_into(file: str, cell, names: List[str], what: str, whole: bool = False) -> None:
    """`whole`: the file may hold no more of this model's structure than `names` (a checkpoint of a bigger model
    is not loaded in part); weights outside it, such as a PPO value head (`value_head.*`), are left out."""
    import mindspore as ms

    try:
        params = ms.load_checkpoint(file, format="safetensors")
    except Exception as err:  # MindSpore raises bare RuntimeError/ValueError for unreadable files
        raise CheckpointError(f"{file}: cannot be read ({str(err).splitlines()[0]}); the file is truncated or "
                              f"not safetensors: copy it again or use an earlier checkpoint") from None
    own = cell.parameters_dict()
    roots = {name.split(".")[0] for name in names}  # e.g. model, lm_head
    extra = sorted(n for n in set(params) - set(names) if n.split(".")[0] in roots) if whole else []
    if extra:
        raise CheckpointError(f"{file}: holds {len(extra)} weights this model does not have (e.g. {extra[0]}): "
                              f"the checkpoint is of another model; set model= to the one it was trained with")
    for name in names:
        if name not in params:
            raise CheckpointError(f"{file}: has no {name}: it is not a {what} of this model")
        if tuple(params[name].shape) != tuple(own[name].shape):
            raise CheckpointError(f"{file}: {name} has shape {tuple(params[name].shape)} but this model needs "
                                  f"{tuple(own[name].shape)}: the checkpoint is of another model size or vocab")
    ms.load_param_into_net(cell, {n: params[n] for n in names}, strict_load=True)


def weights_file(path: str, whole: bool = False) -> str:
    """The weights file of a checkpoint (any form `resolve` takes, or the .safetensors file given); CheckpointError
    if absent, or with `whole` (a whole model's weights wanted: stage.init_from) if it holds a LoRA run's adapters
    only (an adapter_config.json beside it), which would else be refused as another model's weights."""
    path = resolve(path)
    file = os.path.join(path, WEIGHTS) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: no such checkpoint; give a checkpoint directory (.../checkpoints/step_N) "
                              f"or its {WEIGHTS}")
    directory = os.path.dirname(file)
    if whole and os.path.isfile(os.path.join(directory, ADAPTERS)):
        raise CheckpointError(f"{directory}: holds the LoRA adapters of a peft=lora run, not a whole model; merge "
                              f"them into their base first (python -m models.convert {directory} --to mindlab OUT "
                              "--merge-lora) and start from OUT")
    return file


def load_weights(path: str, model, only: Optional[Set[str]] = None) -> None:
    """Model weights (all, or the names in `only`) from a checkpoint directory or a .safetensors file
    (stage.init_from)."""
    file = weights_file(path, whole=only is None)
    _load_into(file, model, sorted(only) if only is not None else list(model.parameters_dict()), "checkpoint",
               whole=only is None)


def load(path: str, model, optimizer, only: Optional[Set[str]] = None) -> dict:
    """Weights (all, or those in `only`, as saved), optimizer state and the loop's state.json, for resuming."""
    state = read_state(path)
    load_weights(path, model, only)
    weights = set(model.parameters_dict())
    _load_into(os.path.join(path, OPTIMIZER), optimizer,
               [n for n in optimizer.parameters_dict() if n not in weights], "optimizer state")
    return state
