"""Evaluate a checkpoint: per-source loss, perplexity and bits per byte next to a unigram baseline, loss by
position in the context, and lm-evaluation-harness style tasks (data/tasks.py); fill-mask accuracy for BERT.

    python -m evaluate CKPT                                    # the checkpoint's own data, every built task
    python -m evaluate CKPT data=corpora_5dom tasks=[definitions_mc,cloze_code] --out results.json
    python -m evaluate CKPT eval.batches=0 eval.context_lengths=[256,512,1024] eval.position_bucket=64
    python -m evaluate CKPT data=corpora_5dom model.rope_scaling.type=linear model.rope_scaling.factor=4 \
        eval.context_lengths=[1024] tasks=[]

Config. The arguments after CKPT are train.py's Hydra overrides, composed the same way (conf/, the typed
schema, base/validate.py), except that:
  - `model` is the checkpoint's (CKPT/config.yaml), registered as the preset `model=_checkpoint`, so single
    keys still override it (`model.rope_scaling.factor=4`) but `model=<preset>` is refused. The native Llama
    is built whatever `model.impl` was (the same weights and logits as MindFormers', any sequence length).
  - `data`, `objective`, and `trainer.{micro_batch_size,eval_batches,seed}` default to the checkpoint's too
    (`data=_checkpoint`, ...), so the validation rows, their batches and BERT's validation masks are the ones
    its training evaluated (the `loss` column reproduces metrics.jsonl's val_loss); `data=<preset>` and
    `data.seq_len=512` work as in train.py. A causal checkpoint is scored with objective=clm (an SFT one too).
  - the tokenizer is the checkpoint's tokenizer.model: the data's cache is reused as it is when it was built
    with that very file (the training run's own data), else data.tokenizer.path points at a copy of it named
    by its SHA-256 under data.cache_dir/tokenizers/, so every checkpoint of a run shares one prepared cache.
  - `tasks=[a,b]` and `eval.<key>=value` are not train.py keys: they are taken out before composing (parsed by
    Hydra's override parser) and checked against EvalConfig below. `tasks=[]` runs none; without `tasks=`
    every <tasks dir>/*.jsonl runs for a causal model (`python -m data.tasks build` writes them), none for BERT.
    A name is <tasks dir>/<name>.jsonl, a path ending in .jsonl is itself; an Alpaca file (data=instructions'
    val.jsonl) is a generation task: its SFT prompt, scored by exact match / ROUGE-L against the output.
Options: --out FILE (default CKPT/eval.json), --tasks-dir DIR (default ${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/tasks).

Measures (causal models):
  loss, ppl      the objective's loss cell over the validation batches, through trainer/callbacks.py's
                 Evaluation and trainer/module.py's LocalModule.evaluate: the code training logs val_loss with.
  bits_per_byte  total NLL (nats) of the scored target tokens / ln 2 / their UTF-8 bytes, from per-token NLLs
                 (TokenNLL, a graph-mode cell). A token's bytes come from its sentencepiece piece (`piece_bytes`):
                 '▁' is one byte (a space), byte-fallback pieces <0xNN> one byte, pad/unk/bos/eos none, other
                 pieces their UTF-8 length; the dummy-prefix '▁' sentencepiece puts before each document's first
                 piece is not text and is not counted (`target_bytes`). Independent of the vocabulary.
  unigram        a baseline per source: add-one smoothed token frequencies of its training split, its
                 cross-entropy on the same target tokens, also in bits per byte.
  by position    mean NLL per bucket of target positions in the row (`loss_by_position`), at data.seq_len and at
                 every eval.context_lengths entry (rows re-packed at that length: only the packing is redone).
  passkey        eval.passkey_lengths: accuracy of picking the hidden key among 10 by log-likelihood, per
                 length and depth (`passkey_accuracy`; the tokenizer only, no data).
  tasks          multiple choice: acc / acc_norm / chance (summed log-likelihood of each choice given the
                 context, `LoglikelihoodScorer`: batched, lengths padded to multiples of 32 so graph mode
                 compiles a few shapes, an eos in front as at a document start, contexts cut on the left to
                 data.seq_len tokens); generation: exact match / ROUGE-L through `generate.make_generate_fn`.
BERT (objective mlm): loss and the objective's metrics as above, and fill-mask top-1 / top-5 accuracy over the
validation batches' masked tokens (masked by the objective's own `mask_tokens`, seeded by trainer.seed as in
training), next to the unigram baseline's (always the most frequent non-special training token).

Generation: `generate.make_generate_fn(model, tokenizer)` returns `generate_fn(prompts: list[str],
max_new_tokens: int) -> list[str]` (greedy continuations with the KV cache, without the prompts).
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import difflib
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from omegaconf import DictConfig, OmegaConf

from argparse import RawDescriptionHelpFormatter

from base.errors import ArgumentParser, ConfigError, entry_point
from base.schema import REPO_ROOT
from plugins import register
from trainer.module import LocalModule

register()

CHECKPOINT_PRESET = "_checkpoint"  # the preset name under which the checkpoint's groups are registered
LN2 = math.log(2.0)
PAD_MULTIPLE = 32  # task rows are padded to a multiple of this (few distinct shapes to compile)


@dataclass
class EvalConfig:
    """The `eval.<key>=value` arguments."""

    batches: Optional[int] = None  # validation batches per source; None: trainer.eval_batches (training's); 0: all
    context_lengths: List[int] = field(default_factory=list)  # more row lengths for loss by position
    position_bucket: int = 128  # target positions per bucket of loss by position
    data: bool = True  # the per-source evaluation (false: tasks only, no data is prepared)
    max_items: int = 0  # items per task (the first ones); 0: all
    max_new_tokens: int = 64  # generation tasks
    # passkey retrieval (Mohtashami & Jaggi 2023): a 5-digit key hidden at each depth (fraction of the filler
    # before it) of a prompt of each length; scored by log-likelihood of the key against 9 other keys
    passkey_lengths: List[int] = field(default_factory=list)
    passkey_depths: List[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    passkey_trials: int = 10  # keys per (length, depth); chance is 1/10


# ------------------------------------------------------------------------------------------ configuration

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
    from base.schema import SAMPLE_KINDS

    return any(s.kind in SAMPLE_KINDS for s in data.sources)


def compose_config(ckpt: str, overrides: Sequence[str]) -> DictConfig:
    """train.py's composition of `overrides` over the checkpoint's model (and, unless overridden, its data,
    objective and validation batching), validated; data.tokenizer set to the checkpoint's tokenizer."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from base.schema import DataConfig
    from base.validate import validate
    from models import family
    from objectives import objective as objective_plugin

    saved_file = os.path.join(ckpt, "config.yaml")
    if not os.path.isfile(saved_file):
        raise ConfigError("checkpoint", f"{saved_file}: not found; CKPT must be a checkpoint directory "
                          "(outputs/<date>/<time>/checkpoints/step_NNNNNN)")
    saved = OmegaConf.load(saved_file)
    given = {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}
    if "model" in given:
        raise ConfigError("model", f"comes from the checkpoint ({saved_file}); override single keys instead, "
                          "e.g. model.rope_scaling.type=linear")
    store = ConfigStore.instance()
    fam = family(saved.model.family)
    model_node = OmegaConf.merge(OmegaConf.structured(fam.Config), saved.model)
    if "impl" in model_node:
        model_node.impl = "native"  # MindFormers' Llama has the same weights and logits, at one fixed length
    model_node.recompute = "none"
    store.store(group="model", name=CHECKPOINT_PRESET, node=model_node)
    head = [f"model={CHECKPOINT_PRESET}"]
    if "data" not in given:
        if "data" not in saved:
            raise ConfigError("data", f"{saved_file} names no data (a converted model?); give one, e.g. data=default")
        if _sample_data(saved.data):
            raise ConfigError("data", f"the checkpoint trained on instruction samples (data={saved.data.name}); "
                              "evaluate it on documents, e.g. data=corpora_5dom or data=default")
        store.store(group="data", name=CHECKPOINT_PRESET, node=OmegaConf.merge(OmegaConf.structured(DataConfig),
                                                                              saved.data))
        head.append(f"data={CHECKPOINT_PRESET}")
    if "objective" not in given and "objective" in saved:
        if fam.CAUSAL and saved.objective.name != "clm":
            head.append("objective=clm")  # an SFT checkpoint is a language model of documents too
        else:
            plugin = objective_plugin(saved.objective.name)
            store.store(group="objective", name=CHECKPOINT_PRESET,
                        node=OmegaConf.merge(OmegaConf.structured(plugin.Config), saved.objective))
            head.append(f"objective={CHECKPOINT_PRESET}")
    for key in ("micro_batch_size", "eval_batches", "seed"):
        if f"trainer.{key}" not in given and key in saved.get("trainer", {}):
            head.append(f"trainer.{key}={saved.trainer[key]}")
    with initialize_config_dir(config_dir=os.path.join(REPO_ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=head + list(overrides))
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


# ---------------------------------------------------------------------------------------------- the model

def load_model(cfg: DictConfig, ckpt: str):
    """The checkpoint's model (a LoRA checkpoint: its base at stage.init_from plus its adapters)."""
    from base import checkpoint
    from models import build_model

    model = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device.target,
                        cfg.trainer.seed)
    saved = OmegaConf.load(os.path.join(ckpt, "config.yaml"))
    peft = saved.get("peft") or {}
    if peft.get("name", "none") != "none":
        from adapters.lora import apply_lora, lora_state

        if saved.stage.init_from:
            checkpoint.load_weights(saved.stage.init_from, model)
        apply_lora(model, peft, cfg.trainer.seed)
        checkpoint.load_weights(ckpt, model, only=set(lora_state(model)))
    else:
        checkpoint.load_weights(ckpt, model)
    model.set_train(False)
    return model


def _cells():
    """The MindSpore cells, defined on first use (importing evaluate stays light)."""
    import mindspore as ms
    from mindspore import nn, ops

    class TokenNLL(nn.Cell):
        """input_ids int32 [B, S + 1] (packed CLM rows) -> (fp32 [B, S]: the NLL (nats) of each target
        input_ids[:, j + 1] given input_ids[:, :j + 1], whose mean is objectives/clm.py's loss; bool [B, S]: the
        target is the most likely token, lm-eval's `is_greedy`)."""

        def __init__(self, model):
            super().__init__(auto_prefix=False)  # keep the model's parameter names
            self.model = model

        def construct(self, input_ids):
            logits = self.model(input_ids[:, :-1]).astype(ms.float32)
            logp = ops.log_softmax(logits, -1)
            targets = input_ids[:, 1:]
            nll = -ops.gather_elements(logp, 2, targets.expand_dims(-1)).squeeze(-1)
            return nll, ops.argmax(logits, -1).astype(targets.dtype) == targets

    class FillMaskTopK(nn.Cell):
        """BERT inputs -> int32 [B, S, k]: the k most likely tokens at every position, best first."""

        def __init__(self, model, k: int = 5):
            super().__init__(auto_prefix=False)
            self.model, self.k = model, k

        def construct(self, input_ids, token_type_ids, attention_mask):
            mlm_logits, _ = self.model(input_ids, token_type_ids, attention_mask)
            return ops.topk(mlm_logits, self.k)[1]

    return TokenNLL, FillMaskTopK


def token_nll_cell(model):
    return _cells()[0](model)


def fill_mask_cell(model, k: int = 5):
    return _cells()[1](model, k)


def token_nll(cell, batches: Sequence[np.ndarray]) -> np.ndarray:
    """[N, S] per-token NLLs of the rows of `batches` (input_ids [B, S + 1] each), float64."""
    from mindspore import Tensor

    return np.concatenate([cell(Tensor(np.asarray(ids, np.int32)))[0].asnumpy().astype(np.float64) for ids in batches])


class EvalModule:
    """What trainer/callbacks.py's Evaluation needs of a TrainModule, without an optimizer: the objective, its
    loss cell, and LocalModule.evaluate itself (training's validation code, unchanged)."""

    evaluate = LocalModule.evaluate

    def __init__(self, model, objective):
        self.model, self.objective = model, objective
        self.loss_net = objective.loss_cell(model)


# --------------------------------------------------------------------------------------- bytes and losses

def piece_bytes(tokenizer) -> np.ndarray:
    """int64 [vocab]: UTF-8 bytes of each piece's text. '▁' is a space (one byte), a byte-fallback piece <0xNN>
    one byte, control / unknown / unused pieces (pad, unk, bos, eos) none, others their UTF-8 length."""
    sp = tokenizer.sp
    out = np.zeros(sp.get_piece_size(), np.int64)
    for i in range(len(out)):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            continue
        out[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return out


def dummy_prefix_pieces(tokenizer) -> Optional[np.ndarray]:
    """bool [vocab]: pieces starting with '▁', when the tokenizer adds a dummy '▁' before each text it encodes
    (sentencepiece's add_dummy_prefix); None when it does not. Told by encoding "x", whose first piece then starts
    with '▁': reading the flag from the model's proto took 0.2 s at 8192 pieces, 0.5 s at 32000 on the way to
    every run's first step (protobuf's pure-Python parser, which importing MindSpore selects)."""
    sp = tokenizer.sp
    if not sp.encode("x", out_type=str)[0].startswith("\u2581"):
        return None
    return np.array([not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i))
                     and sp.id_to_piece(i).startswith("\u2581") for i in range(sp.get_piece_size())])


def target_bytes(input_ids: np.ndarray, table: np.ndarray, eos_id: int = -1,
                 dummy_prefix: Optional[np.ndarray] = None, labels: Optional[np.ndarray] = None) -> np.ndarray:
    """int64 [N, S]: the UTF-8 bytes of each target token input_ids[:, 1:] (`table` = piece_bytes). With
    `dummy_prefix` (dummy_prefix_pieces), a target right after `eos_id` starts a document, and the '▁' its piece
    starts with is sentencepiece's dummy prefix, not a space of the text: one byte less. With `labels` (a causal
    objective's, negative where a token carries no loss, e.g. SFT's prompts), the targets are labels[:, 1:] and
    those without loss count no bytes."""
    ids = np.asarray(input_ids, np.int64)
    targets = ids[:, 1:] if labels is None else np.asarray(labels, np.int64)[:, 1:]
    counted = targets >= 0
    targets = np.where(counted, targets, 0)
    out = table[targets]
    if dummy_prefix is not None:
        out = out - ((ids[:, :-1] == eos_id) & dummy_prefix[targets])
    return out * counted


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    """Total NLL in nats -> bits per UTF-8 byte of the text it scored."""
    return float(nll_nats) / LN2 / n_bytes if n_bytes else float("nan")


def loss_by_position(nll: np.ndarray, bucket: int, mask: Optional[np.ndarray] = None) -> list:
    """Mean NLL per bucket of positions: `nll` [N, S] (row n's target j, predicted from j + 1 tokens of its row),
    buckets [0, bucket), [bucket, 2 bucket), ..., the last one cut at S. `mask` [N, S] (1: counted) leaves
    positions out. Returns [{"start", "end", "tokens", "loss"}, ...]; loss is NaN for a bucket without tokens.
    Rows are packed, so position counts context inside the row, which may start mid-document."""
    nll = np.asarray(nll, np.float64)
    if nll.ndim != 2:
        raise ValueError(f"nll must be [rows, positions], got shape {nll.shape}")
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    weights = np.ones_like(nll) if mask is None else np.asarray(mask, np.float64)
    out = []
    for start in range(0, nll.shape[1], bucket):
        end = min(start + bucket, nll.shape[1])
        w = weights[:, start:end]
        n = float(w.sum())
        out.append({"start": start, "end": end, "tokens": int(n),
                    "loss": float((nll[:, start:end] * w).sum() / n) if n else float("nan")})
    return out


def unigram_nll(train_tokens: np.ndarray, targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """NLL (nats) of each of `targets` under the add-one smoothed unigram distribution of `train_tokens`."""
    counts = np.bincount(np.asarray(train_tokens, np.int64).ravel(), minlength=vocab_size).astype(np.float64)
    logp = np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)
    return -logp[np.asarray(targets, np.int64)]


def fill_mask_counts(topk: np.ndarray, labels: np.ndarray, ignore_index: int = -100) -> Tuple[int, int, int]:
    """(masked tokens, top-1 hits, top-k hits) of predictions `topk` [B, S, k] (best first) against `labels`."""
    labels = np.asarray(labels)
    masked = labels != ignore_index
    hit = np.asarray(topk) == labels[..., None]
    return int(masked.sum()), int((hit[..., 0] & masked).sum()), int((hit.any(-1) & masked).sum())


# -------------------------------------------------------------------------------------------------- tasks

class LoglikelihoodScorer:
    """(context, continuation) pairs -> the summed log-probability of each continuation's tokens, in batches of
    `batch_size` rows through TokenNLL. Each row is eos (a document start, as in the packed training rows), the
    context's tokens, the continuation's (data.tasks.encode_pair: lm-eval's split), cut on the left to
    `max_len` + 1 tokens, padded on the right to a multiple of PAD_MULTIPLE (a causal model's earlier positions
    do not see the padding); rows are sorted by length and a short last batch filled with padding rows."""

    def __init__(self, nll_cell, tokenizer, batch_size: int, max_len: int):
        self.cell, self.tokenizer, self.batch_size, self.max_len = nll_cell, tokenizer, batch_size, max_len

    def encode(self, context: str, continuation: str) -> Tuple[List[int], int]:
        from data.tasks import encode_pair

        ctx, cont = encode_pair(self.tokenizer, context, continuation)
        if not cont:
            raise ValueError(f"the continuation {continuation!r} encodes to no tokens")
        ids = ([self.tokenizer.eos_id] + ctx + cont)[-(self.max_len + 1):]
        return ids, min(len(cont), len(ids) - 1)

    def __call__(self, requests: Sequence[Tuple[str, str]]) -> List[float]:
        return [logp for logp, _ in self.score([self.encode(c, x) for c, x in requests])]

    def score(self, encoded: Sequence[Tuple[List[int], int]]) -> List[Tuple[float, bool]]:
        """Rows (ids, n): the summed log-probability of the last n tokens of ids given the ones before, and
        whether each of them is the model's most likely token (lm-eval's loglikelihood answer)."""
        from mindspore import Tensor

        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
        out = [(0.0, False)] * len(encoded)
        pad = self.tokenizer.pad_id
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            longest = max(len(encoded[i][0]) for i in chunk) - 1  # targets
            width = min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, self.max_len) + 1
            rows = np.full((self.batch_size, width), pad, np.int32)
            for r, i in enumerate(chunk):
                rows[r, :len(encoded[i][0])] = encoded[i][0]
            nll, greedy = (x.asnumpy() for x in self.cell(Tensor(rows)))
            for r, i in enumerate(chunk):
                ids, n = encoded[i]
                span = slice(len(ids) - 1 - n, len(ids) - 1)
                out[i] = (-float(nll[r, span].astype(np.float64).sum()), bool(greedy[r, span].all()))
        return out


def generation_fn(model, tokenizer, cfg) -> Tuple[Optional[Callable], Optional[str]]:
    """(generate_fn, None): greedy continuations with the KV cache (generate.py)."""
    from generate import make_generate_fn

    return make_generate_fn(model, tokenizer), None


def run_tasks(tasks, loglikelihood: Optional[Callable], generate_fn: Optional[Callable], max_new_tokens: int,
              skip_reason: Dict[str, str], log=print) -> dict:
    """Score `tasks` (data.tasks.Task): multiple choice through `loglikelihood`, generation through
    `generate_fn`; a task whose scorer is None is reported as skipped with skip_reason[kind]."""
    from data.tasks import score_generation, score_multiple_choice

    out = {}
    for task in tasks:
        start = time.perf_counter()
        if task.kind == "multiple_choice" and loglikelihood is not None:
            result = score_multiple_choice(task.items, loglikelihood)
        elif task.kind == "generation" and generate_fn is not None:
            result = score_generation(task.items, generate_fn, max_new_tokens)
        else:
            out[task.name] = {"kind": task.kind, "n": len(task.items), "path": task.path,
                              "skipped": skip_reason[task.kind]}
            log(f"[eval] task {task.name} skipped: {skip_reason[task.kind]}")
            continue
        out[task.name] = {"kind": task.kind, "path": task.path, **result,
                          "seconds": round(time.perf_counter() - start, 1)}
        log(f"[eval] task {task.name}: " + ", ".join(f"{k} {result[k]:.4f}" for k in
                                                      ("acc", "acc_norm", "chance", "exact_match", "rouge_l")
                                                      if k in result) + f" (n={result['n']})")
    return out


def load_tasks(names: Optional[List[str]], tasks_dir: Optional[str], max_items: int) -> list:
    """The named task files (None: every *.jsonl of the tasks dir), loaded and checked before anything runs."""
    from data.tasks import default_tasks_dir, load_task, task_path

    directory = Path(tasks_dir) if tasks_dir else default_tasks_dir()
    if names is None:
        names = sorted(p.stem for p in directory.glob("*.jsonl")) if directory.is_dir() else []
        if not names:
            print(f"[eval] no task files in {directory}: no tasks (build them with `python -m data.tasks build`)")
    tasks = [load_task(task_path(name, directory), name=Path(name).stem) for name in names]
    for task in tasks:
        if max_items:
            task.items = task.items[:max_items]
    return tasks


# ---------------------------------------------------------------------------------------- during training

TASK_METRICS = ("acc", "acc_norm", "exact_match", "rouge_l")


def val_target_bytes(val: Dict[str, List[tuple]], tokenizer) -> Dict[str, int]:
    """Per source, the UTF-8 bytes of the loss targets of validation inputs (input_ids, labels, ...) whose loss is
    their mean NLL (an objective with `token_nll`): what turns trainer/callbacks.py's val_loss into bits per byte."""
    table, prefix = piece_bytes(tokenizer), dummy_prefix_pieces(tokenizer)
    return {source: int(sum(target_bytes(inputs[0], table, tokenizer.eos_id, prefix, inputs[1]).sum()
                            for inputs in batches)) for source, batches in val.items()}


def task_scorer(model, tokenizer, names: Sequence[str], max_items: int, batch_size: int, max_len: int,
                max_new_tokens: int = 64) -> Callable[[], dict]:
    """The task files `names` (loaded and checked now: a bad one fails before training starts) ->
    score() -> {"<task>/<metric>": value}, with the scorers `python -m evaluate` uses."""
    from generate import make_generate_fn

    tasks = load_tasks(list(names), None, max_items)
    loglikelihood = LoglikelihoodScorer(token_nll_cell(model), tokenizer, batch_size, max_len)
    generate_fn = make_generate_fn(model, tokenizer) if any(t.kind == "generation" for t in tasks) else None

    def score() -> dict:
        results = run_tasks(tasks, loglikelihood, generate_fn, max_new_tokens, {}, log=lambda *_: None)
        return {f"{name}/{key}": r[key] for name, r in results.items() for key in TASK_METRICS if key in r}

    return score


# ------------------------------------------------------------------------------------------ data sources

def evaluate_sources(cfg: DictConfig, eval_cfg: EvalConfig, model, log=print) -> Tuple[dict, object]:
    """Per-source results over the validation batches (and the DataBundle's tokenizer)."""
    from data import build_data
    from data.cache import prepare
    from data.loader import validation_batches
    from objectives import objective as objective_plugin
    from trainer.callbacks import Evaluation, Sinks

    plugin = objective_plugin(cfg.objective.name)
    spec = plugin.row_spec(cfg.objective)
    mbs = cfg.trainer.micro_batch_size
    n_batches = eval_cfg.batches if eval_cfg.batches is not None else cfg.trainer.eval_batches
    n_batches = n_batches or 1 << 40  # 0: every validation row
    data = build_data(cfg.data, mbs, seed=cfg.trainer.seed, eval_batches=n_batches, spec=spec)
    tokenizer = data.tokenizer
    objective = plugin.Objective(cfg.objective, tokenizer, cfg.trainer.seed)
    val = {source: [objective.batch(b, -1 - i) for i, b in enumerate(batches)] for source, batches in data.val.items()}
    start = time.perf_counter()
    trained_code = Evaluation(Sinks([]), 0, 0, EvalModule(model, objective), val).evaluate()
    log(f"[eval] loss cell over {sum(map(len, val.values()))} batches in {time.perf_counter() - start:.1f}s")
    prepared = prepare(cfg.data, spec)
    vocab = tokenizer.vocab_size
    out = {"sources": {}, "objective": cfg.objective.name, "batches_per_source": {s: len(b) for s, b in val.items()},
           "micro_batch_size": mbs}
    metrics = ("loss",) + tuple(objective.metrics)
    for source in val:
        out["sources"][source] = {m: trained_code[f"val_{m}/{source}"] for m in metrics}
    out["all"] = {m: trained_code[f"val_{m}"] for m in metrics}
    if cfg.objective.name == "clm":  # (BERT's loss adds the sentence task's: its exp is no perplexity)
        for r in list(out["sources"].values()) + [out["all"]]:
            r["ppl"] = math.exp(min(r["loss"], 50.0))

    if cfg.objective.name == "clm":
        table, prefix = piece_bytes(tokenizer), dummy_prefix_pieces(tokenizer)
        cell = token_nll_cell(model)
        by_length: Dict[int, dict] = {}
        totals = {"nats": 0.0, "bytes": 0, "tokens": 0, "unigram_nats": 0.0}
        nll_all = []
        start = time.perf_counter()
        for source, batches in data.val.items():
            rows = [b["input_ids"] for b in batches]
            nll = token_nll(cell, rows)
            ids = np.concatenate(rows)
            n_bytes = target_bytes(ids, table, tokenizer.eos_id, prefix)
            uni = unigram_nll(prepared.tokens(source, "train"), ids[:, 1:], vocab)
            r = out["sources"][source]
            r.update({"rows": int(ids.shape[0]), "tokens": int(nll.size), "bytes": int(n_bytes.sum()),
                      "token_nll_mean": float(nll.mean()), "bits_per_byte": bits_per_byte(nll.sum(), n_bytes.sum()),
                      "unigram_loss": float(uni.mean()), "unigram_bits_per_byte": bits_per_byte(uni.sum(), n_bytes.sum()),
                      "by_position": loss_by_position(nll, eval_cfg.position_bucket)})
            if abs(r["token_nll_mean"] - r["loss"]) > 1e-3 * max(1.0, abs(r["loss"])):
                log(f"[eval] warning: {source}: per-token NLL mean {r['token_nll_mean']:.5f} differs from the loss "
                    f"cell's {r['loss']:.5f}")
            totals["nats"] += float(nll.sum())
            totals["bytes"] += int(n_bytes.sum())
            totals["tokens"] += int(nll.size)
            totals["unigram_nats"] += float(uni.sum())
            nll_all.append(nll)
        log(f"[eval] per-token NLL over {totals['tokens']:,} tokens in {time.perf_counter() - start:.1f}s")
        out["all"].update({"tokens": totals["tokens"], "bytes": totals["bytes"],
                           "bits_per_byte": bits_per_byte(totals["nats"], totals["bytes"]),
                           "unigram_loss": totals["unigram_nats"] / totals["tokens"],
                           "unigram_bits_per_byte": bits_per_byte(totals["unigram_nats"], totals["bytes"])})
        seq_len = cfg.data.seq_len
        by_length[seq_len] = {"all": loss_by_position(np.concatenate(nll_all), eval_cfg.position_bucket),
                              "rows": int(sum(len(n) for n in nll_all))}
        for length in eval_cfg.context_lengths:
            if length == seq_len:
                continue
            if not 2 <= length <= model_window(cfg.model):
                raise ConfigError("eval.context_lengths", f"{length} is outside [2, {model_window(cfg.model)}] (model."
                                  "max_position_embeddings, x model.rope_scaling.factor when scaled); raise it with "
                                  "model.rope_scaling or model.max_position_embeddings")
            data_l = OmegaConf.merge(cfg, {"data": {"seq_len": int(length)}}).data  # (interpolations resolve)
            from data import DataError

            try:
                batches = validation_batches(prepare(data_l, spec), mbs, n_batches)
            except DataError as err:
                by_length[int(length)] = {"skipped": str(err)}
                log(f"[eval] context length {length}: skipped ({err})")
                continue
            start = time.perf_counter()
            set_rope_length(model, length)
            nll = np.concatenate([token_nll(cell, [b["input_ids"] for b in bs]) for bs in batches.values()])
            by_length[int(length)] = {"all": loss_by_position(nll, eval_cfg.position_bucket), "rows": int(len(nll)),
                                      "loss": float(nll.mean())}
            log(f"[eval] context length {length}: {len(nll)} rows in {time.perf_counter() - start:.1f}s")
        by_length[seq_len]["loss"] = totals["nats"] / totals["tokens"]
        out["context_lengths"] = {str(k): v for k, v in sorted(by_length.items())}
        out["position_bucket"] = eval_cfg.position_bucket
    elif cfg.objective.name == "mlm":
        from objectives.mlm import IGNORE_INDEX, SPECIAL_PIECES

        cell = fill_mask_cell(model, 5)
        special = sorted({tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id,
                          *(tokenizer.piece_id(p) for p in SPECIAL_PIECES)})
        from mindspore import Tensor

        totals = np.zeros(3, np.int64)
        uni_nats, uni_hits = 0.0, 0
        for source, batches in val.items():
            counts = np.zeros(3, np.int64)
            train_tokens = prepared.tokens(source, "train")
            freq = np.bincount(np.asarray(train_tokens, np.int64), minlength=vocab)
            freq[special] = 0
            top = int(np.argmax(freq))
            labels = np.concatenate([inputs[3].ravel() for inputs in batches])
            masked = labels[labels != IGNORE_INDEX]
            for inputs in batches:
                topk = cell(*map(Tensor, inputs[:3])).asnumpy()
                counts += fill_mask_counts(topk, inputs[3], IGNORE_INDEX)
            uni = unigram_nll(train_tokens, masked, vocab)
            r = out["sources"][source]
            r.update({"masked_tokens": int(counts[0]), "top1_accuracy": counts[1] / max(counts[0], 1),
                      "top5_accuracy": counts[2] / max(counts[0], 1), "unigram_loss": float(uni.mean()),
                      "unigram_top1_accuracy": float((masked == top).mean()) if masked.size else float("nan"),
                      "unigram_top1_token": tokenizer.sp.id_to_piece(top)})
            totals += counts
            uni_nats += float(uni.sum())
            uni_hits += int((masked == top).sum())
        out["all"].update({"masked_tokens": int(totals[0]), "top1_accuracy": totals[1] / max(totals[0], 1),
                           "top5_accuracy": totals[2] / max(totals[0], 1),
                           "unigram_loss": uni_nats / max(totals[0], 1),
                           "unigram_top1_accuracy": uni_hits / max(totals[0], 1)})
    return out, tokenizer


def model_window(m) -> int:
    """The longest sequence the model serves (RoPE scaling widens a Llama's max_position_embeddings)."""
    from models.llama.rope import window

    return window(m) if "rope_scaling" in m else m.max_position_embeddings


def set_rope_length(model, length: int) -> None:
    """Dynamic NTK's tables for rows of `length` tokens (models/llama/rope.py); nothing for other models."""
    inner = getattr(model, "model", None)
    if hasattr(inner, "set_rope_length"):
        inner.set_rope_length(length)


PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def passkey_rows(tokenizer, length: int, depth: float, key: int, candidates: Sequence[int]):
    """(input_ids [len(candidates), length + 1], candidate token counts): eos, filler with the needle at `depth`
    of it, the question, then each candidate key; the filler is cut so every row is exactly length + 1."""
    needle, question = tokenizer.encode(PASSKEY_NEEDLE.format(key=key)), tokenizer.encode(PASSKEY_QUESTION)
    unit = tokenizer.encode(PASSKEY_FILLER)
    rows, counts = [], []
    for cand in candidates:
        answer = tokenizer.encode(f" {cand}")
        room = length + 1 - 1 - len(needle) - len(question) - len(answer)
        if room < 0:
            raise ConfigError("eval.passkey_lengths", f"{length} tokens cannot hold the needle and the question "
                              f"({length + 1 - room} tokens); use lengths >= 64")
        filler = (unit * (room // len(unit) + 1))[:room]
        cut = int(round(depth * room))
        rows.append([tokenizer.eos_id] + filler[:cut] + needle + filler[cut:] + question + answer)
        counts.append(len(answer))
    return np.array(rows, np.int32), counts


def passkey_accuracy(cell, tokenizer, lengths: Sequence[int], depths: Sequence[float], trials: int,
                     model=None, seed: int = 0, batch_size: int = 10) -> dict:
    """{length: {depth: accuracy}}: the share of trials where the hidden key has the highest summed
    log-likelihood among itself and 9 other random 5-digit keys (chance 0.1). The 10 rows of a trial are scored
    `batch_size` at a time (rounded down to a divisor of 10, so one graph shape per length): all 10 rows of
    2048 tokens at once took 18 GB RSS for model=tiny on CPU."""
    batch_size = max(d for d in (1, 2, 5, 10) if d <= max(batch_size, 1))
    rng = np.random.default_rng(seed)
    out = {}
    for length in lengths:
        set_rope_length(model, length)
        out[str(length)] = {}
        for depth in depths:
            hits = 0
            for _ in range(trials):
                keys = rng.choice(np.arange(10000, 100000), 10, replace=False)
                rows, counts = passkey_rows(tokenizer, int(length), float(depth), int(keys[0]), keys)
                nll = token_nll(cell, [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)])
                scores = [-nll[i, -c:].sum() for i, c in enumerate(counts)]
                hits += int(np.argmax(scores) == 0)
            out[str(length)][str(depth)] = hits / trials
    return out


# ------------------------------------------------------------------------------------------------- report

def _f(value, digits: int = 4) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def format_report(results: dict) -> str:
    lines = [f"checkpoint {results['checkpoint']} (step {results.get('step', '?')}): model {results['model']}, "
             f"data {results['data']}, seq_len {results['seq_len']}"]
    data = results.get("data_eval")
    if data:
        sources = {**data["sources"], "all": data["all"]}
        if data["objective"] == "clm":
            lines += ["", f"{'source':<16} {'tokens':>9} {'loss':>7} {'ppl':>9} {'bits/byte':>9} "
                          f"{'unigram bpb':>11} {'unigram loss':>12}"]
            for name, r in sources.items():
                lines.append(f"{name:<16} {r['tokens']:>9,} {_f(r['loss']):>7} {_f(r['ppl'], 2):>9} "
                             f"{_f(r['bits_per_byte']):>9} {_f(r['unigram_bits_per_byte']):>11} "
                             f"{_f(r['unigram_loss']):>12}")
            lengths = data["context_lengths"]
            lines += ["", f"loss by position in the row (buckets of {data['position_bucket']} target positions; "
                          "all sources)"]
            for length, entry in lengths.items():
                if "skipped" in entry:
                    lines.append(f"  seq_len {length:>5}: skipped ({entry['skipped']})")
                    continue
                lines.append(f"  seq_len {length:>5} ({entry['rows']} rows, loss {_f(entry['loss'])}): " +
                             "  ".join(f"{b['start']}-{b['end']} {_f(b['loss'])}" for b in entry["all"]))
            per_source = [(name, r["by_position"]) for name, r in data["sources"].items()]
            for name, buckets in per_source:
                lines.append(f"  {name:<14} " + "  ".join(f"{b['start']}-{b['end']} {_f(b['loss'])}" for b in buckets))
        else:
            metrics = [k for k in data["all"] if k not in ("masked_tokens", "unigram_top1_token")]
            lines += ["", f"{'source':<16} " + " ".join(f"{k:>{max(len(k), 8)}}" for k in metrics)]
            for name, r in sources.items():
                lines.append(f"{name:<16} " + " ".join(f"{_f(r.get(k)):>{max(len(k), 8)}}" for k in metrics))
    passkey = results.get("passkey")
    if passkey:
        depths = list(next(iter(passkey.values())))
        lines += ["", "passkey accuracy (10 candidate keys, chance 0.10) by length and depth",
                  f"{'length':>8} " + " ".join(f"{'depth ' + d:>10}" for d in depths)]
        for length, by_depth in passkey.items():
            lines.append(f"{length:>8} " + " ".join(f"{by_depth[d]:>10.2f}" for d in depths))
    tasks = results.get("tasks") or {}
    if tasks:
        lines += ["", f"{'task':<18} {'kind':<15} {'n':>5} {'acc':>7} {'acc_norm':>8} {'chance':>7} "
                      f"{'exact':>7} {'rouge_l':>7}"]
        for name, r in tasks.items():
            if "skipped" in r:
                lines.append(f"{name:<18} {r['kind']:<15} {r['n']:>5}  skipped: {r['skipped']}")
                continue
            lines.append(f"{name:<18} {r['kind']:<15} {r['n']:>5} {_f(r.get('acc')):>7} {_f(r.get('acc_norm')):>8} "
                         f"{_f(r.get('chance')):>7} {_f(r.get('exact_match')):>7} {_f(r.get('rouge_l')):>7}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- main

def run(ckpt: str, cfg: DictConfig, eval_cfg: EvalConfig, tasks: list, log=print) -> dict:
    from base import checkpoint
    from data import Tokenizer
    from trainer.runtime import init_runtime

    init_runtime(cfg)
    state = checkpoint.read_state(ckpt)
    start = time.perf_counter()
    model = load_model(cfg, ckpt)
    results = {"checkpoint": os.path.abspath(ckpt), "step": state.get("step"),
               "model": f"{cfg.model.family} {cfg.model.name}", "data": cfg.data.name, "seq_len": cfg.data.seq_len,
               "overrides": None, "eval": OmegaConf.to_container(OmegaConf.structured(eval_cfg))}
    tokenizer = None
    if eval_cfg.data:
        results["data_eval"], tokenizer = evaluate_sources(cfg, eval_cfg, model, log)
    tokenizer = tokenizer or Tokenizer(cfg.data.tokenizer.path or os.path.join(ckpt, "tokenizer.model"))
    if eval_cfg.passkey_lengths:
        for length in eval_cfg.passkey_lengths:
            if not 64 <= length <= model_window(cfg.model):
                raise ConfigError("eval.passkey_lengths", f"{length} is outside [64, {model_window(cfg.model)}]")
        start = time.perf_counter()
        results["passkey"] = passkey_accuracy(token_nll_cell(model), tokenizer, eval_cfg.passkey_lengths,
                                              eval_cfg.passkey_depths, eval_cfg.passkey_trials, model,
                                              cfg.trainer.seed, cfg.trainer.micro_batch_size)
        log(f"[eval] passkey in {time.perf_counter() - start:.1f}s")
    if tasks:
        from models import family

        causal = family(cfg.model.family).CAUSAL
        skip = {"multiple_choice": "log-likelihood scoring needs a causal model",
                "generation": "generation needs a causal model"}
        loglikelihood = generate_fn = None
        if causal:
            loglikelihood = LoglikelihoodScorer(token_nll_cell(model), tokenizer, cfg.trainer.micro_batch_size,
                                                cfg.data.seq_len)
            if any(t.kind == "generation" for t in tasks):
                generate_fn, skip["generation"] = generation_fn(model, tokenizer, cfg)
        results["tasks"] = run_tasks(tasks, loglikelihood, generate_fn, eval_cfg.max_new_tokens, skip, log)
    results["seconds"] = round(time.perf_counter() - start, 1)
    return results


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m evaluate", description=__doc__.split("\n\n")[0],
                            formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory (.../checkpoints/step_NNNNNN)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides, tasks=[...], eval.<key>=value")
    parser.add_argument("--out", default=None, help="JSON results file (default: CKPT/eval.json)")
    parser.add_argument("--tasks-dir", default=None, help="where task names are looked up (default: "
                        "${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/tasks)")
    args = parser.parse_intermixed_args(argv)
    from models import family

    eval_cfg, task_names, overrides = split_arguments(args.overrides)
    cfg = compose_config(args.checkpoint, overrides)
    if task_names is None and not family(cfg.model.family).CAUSAL:
        task_names = []  # the built tasks are scored by log-likelihood: a causal model's
    tasks = load_tasks(task_names, args.tasks_dir, eval_cfg.max_items)
    results = run(args.checkpoint, cfg, eval_cfg, tasks)
    results["overrides"] = list(args.overrides)
    print()
    print(format_report(results))
    out = args.out or os.path.join(args.checkpoint, "eval.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=_json_default)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
