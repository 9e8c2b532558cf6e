"""One checkpoint evaluated: the per-source measures (evaluation/sources.py), passkey retrieval and the tasks.
The runtime (MindSpore's mode and device) is the caller's to set up first, as for training."""
import os
import time

from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError


def run(ckpt: str, cfg: DictConfig, eval_cfg, tasks: list, log=print) -> dict:
    """The results `python -m evaluation` writes as JSON: the checkpoint, data_eval (sources), passkey, tasks."""
    from base import checkpoint
    from base.registry import OBJECTIVES
    from data import Tokenizer
    from evaluation.model import load_model
    from evaluation.passkey import passkey_accuracy
    from evaluation.sources import evaluate_sources
    from evaluation.tasks import run_tasks, scorers
    from models import context_window, set_context_length

    plugin = OBJECTIVES[cfg.objective.name]
    window = context_window(cfg.model)
    for length in eval_cfg.context_lengths:  # checked before minutes of loading and scoring
        if not 2 <= length <= window:
            raise ConfigError("eval.context_lengths", f"{length} is outside [2, {window}] (model."
                              "max_position_embeddings, x model.rope_scaling.factor when scaled); raise it with "
                              "model.rope_scaling or model.max_position_embeddings")
    if eval_cfg.passkey_lengths and plugin.Objective.token_nll is None:
        raise ConfigError("eval.passkey_lengths", f"passkey retrieval scores keys by a per-token NLL, which "
                          f"objective={cfg.objective.name} has none of (token_nll); set eval.passkey_lengths=[]")
    for length in eval_cfg.passkey_lengths:
        if not 64 <= length <= window:
            raise ConfigError("eval.passkey_lengths", f"{length} is outside [64, {window}]")
    state = checkpoint.read_state(ckpt)
    start = time.perf_counter()
    model = load_model(cfg, ckpt)
    tokenizer = Tokenizer(cfg.data.tokenizer.path or os.path.join(ckpt, "tokenizer.model"))
    objective = plugin.Objective(cfg.objective, tokenizer, cfg.trainer.seed)
    results = {"checkpoint": os.path.abspath(ckpt), "step": state.get("step"),
               "model": f"{cfg.model.family} {cfg.model.name}", "data": cfg.data.name, "seq_len": cfg.data.seq_len,
               "overrides": None, "eval": OmegaConf.to_container(OmegaConf.structured(eval_cfg))}
    if eval_cfg.data:
        results["data_eval"] = evaluate_sources(cfg, eval_cfg, model, objective, log)
    if eval_cfg.passkey_lengths:
        passkey_start = time.perf_counter()
        results["passkey"] = passkey_accuracy(objective.token_nll(model), tokenizer, eval_cfg.passkey_lengths,
                                              eval_cfg.passkey_depths, eval_cfg.passkey_trials,
                                              lambda n: set_context_length(cfg.model.family, model, n),
                                              cfg.trainer.seed, cfg.trainer.micro_batch_size)
        log(f"[eval] passkey in {time.perf_counter() - passkey_start:.1f}s")
    if tasks:
        loglikelihood, generate_fn, skip = scorers(objective, model, cfg.model.family, tokenizer,
                                                   cfg.trainer.micro_batch_size, cfg.data.seq_len)
        results["tasks"] = run_tasks(tasks, loglikelihood, generate_fn, eval_cfg.max_new_tokens, skip, log)
    results["seconds"] = round(time.perf_counter() - start, 1)
    return results
