"""Instruction samples: stage 1 for sources of kind alpaca, chat, prompt_completion (SFT, PPO's prompts) and
preference (the reward model, DPO). The rows each objective makes of them are its own (objectives/sft.py,
objectives/ppo.py, objectives/_preference.py).

Formats (each JSONL line, or each element of a JSON list for alpaca `.json` files, is one sample):
- `alpaca`: {"instruction", "input" (optional), "output"}: Stanford Alpaca's format.
- `chat`: {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}, multi-turn; at
  least one assistant turn.
- `prompt_completion`: {"prompt", "completion"}.
- `preference` (reward model, DPO: objectives/rm.py, objectives/dpo.py): {"chosen", "rejected"} and the
  prompt as {"instruction", "input"} (the template's prompt, as alpaca) or {"prompt"} (plain text, as
  prompt_completion); or "chosen" and "rejected" as chat `messages` lists that hold the prompt themselves.
  Optional "margin" (a number >= 0, default 0: how much better chosen is). A pair becomes two samples,
  chosen then rejected, side by side in the stream (sample 2i and 2i + 1) with their margin in
  `.margin.npy`; a pair is held out or kept whole.

Templates (`data.template`): a sample becomes parts of text that carry loss or not, in order: the prompt
(template text, instruction, input, user and system turns) carries none; every response (assistant turn,
output, completion) carries loss, and so do the template's `assistant_end` text and the eos that follow
each response, so the model learns to stop. `alpaca` (the default) is Stanford Alpaca's two prompts, with and
without input; `chatml` writes `<|im_start|>role\\n...<|im_end|>` turns. Any part can be overridden in YAML.
Template markers are encoded as ordinary text with the checkpoint's tokenizer (`<|im_start|>` becomes
several pieces), so the checkpoint's vocabulary stays valid: no token is added.

Tokens get their loss flag from sentencepiece's byte offsets: a token carries loss when its last byte lies in
a loss-bearing part. Written per source and split, like data/documents.py: `tokens/<source>.<split>.npy`
(each sample's ids then its final eos), `.offsets.npy` (sample starts, then the end) and `.loss_mask.npy`
(uint8). The tokenizer is the checkpoint's (`data.tokenizer.path`), never trained here.
"""
from __future__ import annotations

import gzip
import json
import time
import zlib
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np

from base.schema import PREFERENCE_KINDS, DataConfig, TemplateConfig
from data.documents import split_documents
from data.errors import DataError
from data.sources import source_files
from data.tokenizer import Tokenizer, build_tokenizer
from omegaconf import OmegaConf

EOS = None  # a part that is the eos token, not text
TEMPLATES = {
    "alpaca": dict(
        prompt_input="Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        prompt_no_input="Below is an instruction that describes a task. Write a response that appropriately "
                        "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n",
        system="{content}\n\n", user="### Instruction:\n{content}\n\n### Response:\n", assistant_start="",
        assistant_end=""),
    "chatml": dict(
        prompt_input="<|im_start|>user\n{instruction}\n\n{input}<|im_end|>\n<|im_start|>assistant\n",
        prompt_no_input="<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
        system="<|im_start|>system\n{content}<|im_end|>\n", user="<|im_start|>user\n{content}<|im_end|>\n",
        assistant_start="<|im_start|>assistant\n", assistant_end="<|im_end|>"),
}
Part = Tuple[object, bool]  # (text, or EOS; carries loss)


def template_parts(cfg: TemplateConfig) -> Dict[str, str]:
    """The template's strings: the built-in `cfg.name` with the keys set in cfg overriding it."""
    if cfg.name not in TEMPLATES and cfg.name != "custom":
        raise DataError(f"data.template.name: got {cfg.name!r}; choose one of {', '.join(TEMPLATES)}, custom")
    base = dict(TEMPLATES.get(cfg.name, {}))
    base.update({k: getattr(cfg, k) for k in TEMPLATES["alpaca"] if getattr(cfg, k) is not None})
    missing = [k for k in TEMPLATES["alpaca"] if k not in base]
    if missing:
        raise DataError(f"data.template: name=custom needs every part; missing {', '.join(missing)}")
    return base


def render(sample: dict, kind: str, t: Dict[str, str]) -> List[Part]:
    """The sample's parts, in order (see the module docstring)."""
    if kind == "alpaca":
        prompt = t["prompt_input" if sample.get("input") else "prompt_no_input"]
        return [(prompt.format(instruction=sample["instruction"], input=sample.get("input", "")), False),
                (sample["output"], True), (t["assistant_end"], True), (EOS, True)]
    if kind == "prompt_completion":
        return [(sample["prompt"], False), (sample["completion"], True), (t["assistant_end"], True), (EOS, True)]
    parts: List[Part] = []
    for message in sample["messages"]:
        if message["role"] == "assistant":
            parts += [(t["assistant_start"], False), (message["content"], True), (t["assistant_end"], True),
                      (EOS, True)]
        else:
            parts.append((t[message["role"]].format(content=message["content"]), False))
    return parts


def render_pair(pair: dict, t: Dict[str, str]) -> List[List[Part]]:
    """A preference pair's two samples, [chosen parts, rejected parts]: the same prompt, rendered as alpaca
    (instruction/input), prompt_completion (prompt) or chat (messages lists)."""
    def sample(response):
        if isinstance(response, list):
            return render({"messages": response}, "chat", t)
        if "instruction" in pair:
            return render({"instruction": pair["instruction"], "input": pair.get("input", ""), "output": response},
                          "alpaca", t)
        return render({"prompt": pair["prompt"], "completion": response}, "prompt_completion", t)

    return [sample(pair["chosen"]), sample(pair["rejected"])]


def template_of(config) -> Dict[str, str]:
    """The template a run's instruction samples were rendered with: its config's data.template (a checkpoint's
    config.yaml; alpaca's without one)."""
    saved = OmegaConf.select(config, "data.template") or {}
    return template_parts(OmegaConf.merge(OmegaConf.structured(TemplateConfig), saved))


def prompt_parts(record: dict, t: Dict[str, str]) -> List[Part]:
    """What a model trained on these samples is prompted with, as it saw it in training: an instruction (and
    input) as the alpaca prompt, or a chat's messages (earlier assistant turns closed by their eos) then the
    assistant's start. Generation (`python -m generate --instruction`) continues after it."""
    if "messages" in record:
        return render({"messages": list(record["messages"])}, "chat", t) + [(t["assistant_start"], False)]
    return render({"instruction": record["instruction"], "input": record.get("input", ""), "output": ""},
                  "alpaca", t)[:1]


def chat_template(t: Dict[str, str]) -> str:
    """The template as a Hugging Face chat template (Jinja), rendering what training rendered: a single user message
    as the alpaca prompt without input (what an instruction sample is prompted with), any other conversation turn by
    turn (system, user, assistant with its end and eos); add_generation_prompt adds the assistant's start."""
    def lit(text: str) -> str:
        return json.dumps(text)

    def fill(part: str, field: str) -> str:  # "...{field}..." -> a Jinja expression around the message's content
        before, _, after = part.partition("{" + field + "}")
        return f"{lit(before)} + message['content'] + {lit(after)}"

    return ("{%- if messages|length == 1 and messages[0]['role'] == 'user' -%}"
            "{%- for message in messages -%}{{ " + fill(t["prompt_no_input"], "instruction") + " }}{%- endfor -%}"
            "{%- else -%}{%- for message in messages -%}"
            "{%- if message['role'] == 'system' -%}{{ " + fill(t["system"], "content") + " }}"
            "{%- elif message['role'] == 'user' -%}{{ " + fill(t["user"], "content") + " }}"
            "{%- else -%}{{ " + lit(t["assistant_start"]) + " + message['content'] + " + lit(t["assistant_end"]) +
            " + eos_token }}{%- endif -%}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{ " + lit(t["assistant_start"]) + " }}{%- endif -%}{%- endif -%}")


def encode_parts(tokenizer: Tokenizer, parts: List[Part]) -> Tuple[List[int], List[int]]:
    """(ids, loss flags). Consecutive text parts are encoded as one string (so no token boundary is forced
    between them); a token carries loss when its last byte is in a loss-bearing part."""
    ids: List[int] = []
    flags: List[int] = []
    run: List[Part] = []
    for text, loss in parts + [(EOS, False)]:
        if text is not EOS:
            run.append((text, loss))
            continue
        if run:
            joined = "".join(t for t, _ in run)
            ends = np.cumsum([len(t.encode()) for t, _ in run])  # byte end of every part
            for piece in tokenizer.sp.encode(joined, return_type="proto").pieces:
                last = max(piece.end - 1, piece.begin)
                ids.append(piece.id)
                flags.append(int(run[int(np.searchsorted(ends, last, side="right"))][1]))
            run = []
        ids.append(tokenizer.eos_id)
        flags.append(int(loss))
    return ids[:-1], flags[:-1]  # the sentinel eos closing the loop is not part of the sample


def read_samples(source) -> Iterator[Tuple[dict, str]]:
    """(sample, "file:line") of a source of kind alpaca, chat or prompt_completion (its `paths`), checked field
    by field."""
    for path in source_files(source):
        for record, where in _records(path):
            yield _checked(record, source.kind, where), where


def _records(path: Path) -> Iterator[Tuple[object, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read it ({e}); re-create the file") from e
    if path.suffix == ".json" or path.name.endswith(".json.gz"):  # Alpaca's own release: one JSON list
        try:
            records = json.loads(data)
        except ValueError as e:
            raise DataError(f"{path}: invalid JSON ({e}); a .json file holds one list of samples") from e
        if not isinstance(records, list):
            raise DataError(f"{path}: expected a JSON list of samples, got {type(records).__name__}")
        yield from ((r, f"{path}: sample {i}") for i, r in enumerate(records, 1))
        return
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if line.strip():
            try:
                yield json.loads(line), f"{path}:{lineno}"
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e}); every line must be one JSON object") from e


def _checked(record: object, kind: str, where: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if kind in PREFERENCE_KINDS:
        return _checked_pair(record, where)
    required = {"alpaca": ("instruction", "output"), "prompt_completion": ("prompt", "completion"),
                "chat": ("messages",)}[kind]
    for key in required:
        if key not in record:
            raise DataError(f"{where}: no field '{key}' (keys: {', '.join(sorted(record))[:200]}); a {kind} "
                            f"sample needs {', '.join(required)}")
    if kind == "chat":
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                     and m.get("role") in ("system", "user", "assistant")
                                                     for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{role: system|user|assistant, content: str}}")
        responses = [m["content"] for m in messages if m["role"] == "assistant"]
    else:
        for key in record:
            if key in ("instruction", "input", "output", "prompt", "completion") and not isinstance(record[key], str):
                raise DataError(f"{where}: field '{key}' is {type(record[key]).__name__}, expected a string")
        responses = [record["output" if kind == "alpaca" else "completion"]]
    if not responses or not all(r.strip() for r in responses):
        raise DataError(f"{where}: empty response; every sample needs a non-empty "
                        f"{'assistant turn' if kind == 'chat' else required[-1]} to learn from")
    return record


def _checked_pair(pair: dict, where: str) -> dict:
    for key in ("chosen", "rejected"):
        if key not in pair:
            raise DataError(f"{where}: no field '{key}' (keys: {', '.join(sorted(pair))[:200]}); a preference pair "
                            f"needs chosen, rejected and a prompt (instruction, prompt, or chat messages)")
    chat = [isinstance(pair[k], list) for k in ("chosen", "rejected")]
    if chat == [True, True]:
        for key in ("chosen", "rejected"):
            _checked({"messages": pair[key]}, "chat", f"{where}: '{key}'")
    elif chat == [False, False]:
        if "instruction" not in pair and "prompt" not in pair:
            raise DataError(f"{where}: no prompt; a preference pair with text responses needs 'instruction' (with "
                            f"optional 'input') or 'prompt'")
        for key in ("instruction", "input", "prompt", "chosen", "rejected"):
            if key in pair and not isinstance(pair[key], str):
                raise DataError(f"{where}: field '{key}' is {type(pair[key]).__name__}, expected a string")
        if not (pair["chosen"].strip() and pair["rejected"].strip()):
            raise DataError(f"{where}: empty response; chosen and rejected must both be non-empty")
    else:
        raise DataError(f"{where}: 'chosen' and 'rejected' must both be strings or both be chat message lists")
    if pair["chosen"] == pair["rejected"]:
        raise DataError(f"{where}: chosen and rejected are identical, so the pair says nothing; drop it")
    margin = pair.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise DataError(f"{where}: 'margin' must be a number >= 0, got {margin!r}")
    return pair


def build_samples(cfg: DataConfig, out: Path) -> dict:
    """Stage 1 for instruction sources into the empty directory `out`; returns the meta it wrote."""
    start = time.perf_counter()
    if not cfg.tokenizer.path:
        raise DataError("data.tokenizer.path: instruction data is tokenized with the checkpoint's tokenizer, never "
                        "a new one; set it (stage=sft sets it to ${stage.init_from}/tokenizer.model)")
    tokenizer = build_tokenizer(cfg.tokenizer, {}, out / "tokenizer.model")
    parts = template_parts(cfg.template)
    (out / "tokens").mkdir()
    counts = {}
    for source in cfg.sources:
        pairs = source.kind in PREFERENCE_KINDS
        records = [s for s, _ in read_samples(source)]
        if not records:
            raise DataError(f"data source '{source.name}' has no samples; check data.sources[].paths")
        if source.val_paths:  # the held-out file(s)
            held_out = OmegaConf.merge(source, {"paths": list(source.val_paths)})
            splits = {"train": records, "val": [s for s, _ in read_samples(held_out)]}
        else:  # split by the rendered sample (a pair: both of its samples)
            keys = [json.dumps(render_pair(r, parts) if pairs else render(r, source.kind, parts)) for r in records]
            val_keys = set(split_documents(keys, cfg.val_fraction)[1])
            splits = {"train": [r for r, k in zip(records, keys) if k not in val_keys],
                      "val": [r for r, k in zip(records, keys) if k in val_keys]}
        counts[source.name] = {"docs_read": sum(map(len, splits.values())), "removed": {},
                               "docs_kept": sum(map(len, splits.values()))}
        for split, chosen in splits.items():
            rendered = [p for r in chosen for p in render_pair(r, parts)] if pairs else \
                [render(r, source.kind, parts) for r in chosen]
            if pairs:
                np.save(out / "tokens" / f"{source.name}.{split}.margin.npy",
                        np.array([float(r.get("margin", 0.0)) for r in chosen], np.float32))
            encoded = [encode_parts(tokenizer, p) for p in rendered]
            lengths = [len(ids) for ids, _ in encoded]
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            tokens = np.array([i for ids, _ in encoded for i in ids], tokenizer.token_dtype)
            mask = np.array([f for _, flags in encoded for f in flags], np.uint8)
            np.save(out / "tokens" / f"{source.name}.{split}.npy", tokens)
            np.save(out / "tokens" / f"{source.name}.{split}.offsets.npy", offsets)
            np.save(out / "tokens" / f"{source.name}.{split}.loss_mask.npy", mask)
            counts[source.name][split] = {"docs": len(rendered), "tokens": int(offsets[-1]),
                                          "loss_tokens": int(mask.sum())}
        print(f"[data] {source.name}: {len(splits['train']):,} {'pairs' if pairs else 'samples'}, "
              f"{len(splits['val']):,} held out; "
              f"{counts[source.name]['train']['loss_tokens'] / max(counts[source.name]['train']['tokens'], 1):.1%} "
              f"of the training tokens carry loss", flush=True)
    meta = {"name": cfg.name, "dtype": tokenizer.token_dtype.name, "splits": ["train", "val"], "samples": True,
            "tokenizer": {"vocab_size": tokenizer.vocab_size, "trained_here": False, "pad_id": tokenizer.pad_id,
                          "eos_id": tokenizer.eos_id}, "template": parts, "sources": counts,
            "seconds": {"samples": round(time.perf_counter() - start, 3)}}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
