"""Instruction samples: stage 1 for sources of an instruction format (SFT, PPO's prompts) or a preference format
(the reward model, DPO). The rows each objective makes of them are its own (objectives/sft.py,
objectives/ppo.py, objectives/_preference.py).

Formats: each JSONL line, or each element of a `.json` file's one list, is one record, turned into the canonical
sample or pair by its format's normaliser (data/formats.py: alpaca, sharegpt, chat, prompt_completion; preference,
feedback, hh, rated; `kind: auto` detects it). A preference pair becomes two samples, chosen then rejected, side by
side in the stream (sample 2i and 2i + 1) with its margin (>= 0, how much better chosen is) in `.margin.npy`; a
pair is held out or kept whole.

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
import re
import string
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from base.schema import DataConfig, TemplateConfig
from data.documents import split_documents
from data.errors import DataError
from data.formats import Format, NoPreference, format_of, normalise
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
    # the template of the article this repo follows (its instruction tuning writes "### 指令: {inst}\n### 输入: {inp}
    # \n### 输出: {out}", its reward model's inputs the same without 输入)
    "alpaca_zh": dict(
        prompt_input="### 指令: {instruction}\n### 输入: {input}\n### 输出: ",
        prompt_no_input="### 指令: {instruction}\n### 输出: ",
        system="{content}\n", user="### 指令: {content}\n### 输出: ", assistant_start="", assistant_end=""),
}
FIELDS = {"prompt_input": ("instruction", "input"), "prompt_no_input": ("instruction", "input"),
          "system": ("content",), "user": ("content",)}  # what each formatted part fills in
_ESCAPE = re.compile(r"\\(\\|n|t)")  # \n, \t and \\ typed as two characters
Part = Tuple[object, bool]  # (text, or EOS; carries loss)


def template_parts(cfg: TemplateConfig) -> Dict[str, str]:
    """The template's strings: the built-in `cfg.name` (alpaca when unset) with the keys set in cfg overriding it,
    each checked. Escapes typed as two characters are what they mean on a command line (`\\n` a newline, `\\t` a
    tab, `\\\\` a backslash). A prompt may end in `{output}`, as templates are often written whole: the prompt is
    the text before it, and text after it is the end of the response (assistant_end)."""
    name = cfg.name or "alpaca"
    if name not in TEMPLATES and name != "custom":
        raise DataError(f"data.template.name: got {name!r}; choose one of {', '.join(TEMPLATES)}, custom")
    given = {k: _ESCAPE.sub(lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], getattr(cfg, k))
             for k in TEMPLATES["alpaca"] if getattr(cfg, k) is not None}
    parts = {**TEMPLATES.get(name, {}), **given}
    missing = [k for k in TEMPLATES["alpaca"] if k not in parts]
    if missing:
        raise DataError(f"data.template: name=custom needs every part; missing {', '.join(missing)}")
    for key in ("prompt_input", "prompt_no_input"):
        prompt, marker, end = parts[key].partition("{output}")
        if marker and end and end != parts["assistant_end"] and "assistant_end" in given:
            raise DataError(f"data.template.{key}: {end!r} follows {{output}} but assistant_end is "
                            f"{parts['assistant_end']!r}; give the end of a response once")
        parts[key], parts["assistant_end"] = prompt, (end if marker and end else parts["assistant_end"])
    for key, fields in FIELDS.items():
        try:
            used = {f for _, f, _, _ in string.Formatter().parse(parts[key]) if f is not None}
        except ValueError as e:
            raise DataError(f"data.template.{key}: {parts[key]!r} is not a template ({e}); write {{{{ and }}}} "
                            f"for a literal brace") from None
        strange = sorted(used - set(fields))
        if strange:
            raise DataError(f"data.template.{key}: {{{strange[0]}}} is not filled in; it fills "
                            f"{', '.join('{' + f + '}' for f in fields)}" + (
                                " (and {output} at its end)" if key.startswith("prompt") else ""))
    return parts


def render(sample: dict, t: Dict[str, str]) -> List[Part]:
    """A canonical sample's parts, in order (see the module docstring), by its shape (data/formats.py)."""
    if "messages" not in sample:
        prompt = (t["prompt_input" if sample.get("input") else "prompt_no_input"].format(
            instruction=sample["instruction"], input=sample.get("input", "")) if "instruction" in sample
            else sample["prompt"])
        response = sample["output"] if "output" in sample else sample["completion"]
        return [(prompt, False), (response, True), (t["assistant_end"], True), (EOS, True)]
    parts: List[Part] = []
    for message in sample["messages"]:
        if message["role"] == "assistant":
            parts += [(t["assistant_start"], False), (message["content"], True), (t["assistant_end"], True),
                      (EOS, True)]
        else:
            parts.append((t[message["role"]].format(content=message["content"]), False))
    return parts


def render_pair(pair: dict, t: Dict[str, str]) -> List[List[Part]]:
    """A canonical preference pair's two samples, [chosen parts, rejected parts]: the same prompt (instruction
    and input, prompt, or the turns the message lists hold)."""
    def sample(response):
        if isinstance(response, list):
            return render({"messages": response}, t)
        if "instruction" in pair:
            return render({"instruction": pair["instruction"], "input": pair.get("input", ""), "output": response}, t)
        return render({"prompt": pair["prompt"], "completion": response}, t)

    return [sample(pair["chosen"]), sample(pair["rejected"])]


def template_of(config, name: Optional[str] = None) -> Dict[str, str]:
    """The template a run's instruction samples were rendered with: its config's data.template (a checkpoint's
    config.yaml; alpaca's without one), or the built-in `name` instead, which is said on stderr when it differs."""
    saved = OmegaConf.merge(OmegaConf.structured(TemplateConfig), OmegaConf.select(config, "data.template") or {})
    if name is None:
        return template_parts(saved)
    chosen = template_parts(OmegaConf.merge(OmegaConf.structured(TemplateConfig), {"name": name}))
    if chosen != template_parts(saved):
        own = (saved.name or "alpaca") + (" with parts of its own" if any(
            saved[k] is not None for k in TEMPLATES["alpaca"]) else "")
        print(f"[template] {name}, not the checkpoint's own ({own})", file=sys.stderr)
    return chosen


def prompt_parts(record: dict, t: Dict[str, str]) -> List[Part]:
    """What a model trained on these samples is prompted with, as it saw it in training: an instruction (and
    input) as the alpaca prompt, or a chat's messages (earlier assistant turns closed by their eos) then the
    assistant's start. Generation (`python -m generate --instruction`) continues after it."""
    if "messages" in record:
        return render({"messages": list(record["messages"])}, t) + [(t["assistant_start"], False)]
    return render({"instruction": record["instruction"], "input": record.get("input", ""), "output": ""}, t)[:1]


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


@dataclass
class Read:
    """A source's records, normalised: its format, (sample or pair, "file:line") and how many were left out."""

    format: Format
    samples: List[Tuple[dict, str]]
    ties_dropped: int = 0


def read_samples(source, paths: Optional[List[str]] = None) -> Read:
    """Every record of the source's files (or of `paths`, its held-out files), normalised by the format its kind
    names (kind auto: the one its first record looks like)."""
    form, samples, dropped = None, [], 0
    for path in source_files(OmegaConf.merge(source, {"paths": list(paths)}) if paths else source):
        for record, where in _records(path):
            form = form or format_of(source.kind, record, where)
            try:
                samples.append((normalise(form, record, where), where))
            except NoPreference:
                if source.ties != "drop":
                    raise
                dropped += 1
    if not samples:
        raise DataError(f"data source '{source.name}' has no samples" + (
            f" ({dropped:,} left out as ties)" if dropped else "") + "; check data.sources[].paths")
    return Read(form, samples, dropped)


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
    array = "the file holds one JSON list, not a record per line: name it .json"
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e}); " + (
                    array if data.lstrip().startswith(b"[") else "every line must be one JSON object")) from e
            if isinstance(record, list) and lineno == 1:
                raise DataError(f"{path}:1: a JSON list; {array}")
            yield record, f"{path}:{lineno}"


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
        read = [read_samples(source)] + ([read_samples(source, source.val_paths)] if source.val_paths else [])
        pairs = read[0].format.pairs
        for other in read[1:]:
            if other.format.pairs != pairs:
                raise DataError(f"data source '{source.name}': its val_paths hold {other.format.name} records, its "
                                f"paths {read[0].format.name} records; give both files in one family of formats")
        records = [s for s, _ in read[0].samples]
        if source.val_paths:  # the held-out file(s)
            splits = {"train": records, "val": [s for s, _ in read[1].samples]}
        else:  # split by the rendered sample (a pair: both of its samples)
            keys = [json.dumps(render_pair(r, parts) if pairs else render(r, parts)) for r in records]
            val_keys = set(split_documents(keys, cfg.val_fraction)[1])
            splits = {"train": [r for r, k in zip(records, keys) if k not in val_keys],
                      "val": [r for r, k in zip(records, keys) if k in val_keys]}
        dropped = sum(r.ties_dropped for r in read)
        counts[source.name] = {"format": read[0].format.name, "docs_read": sum(map(len, splits.values())) + dropped,
                               "removed": {"ties": dropped} if pairs else {},
                               "docs_kept": sum(map(len, splits.values()))}
        if dropped:
            print(f"[data] {source.name}: {dropped:,} records that prefer neither response left out "
                  f"(data.sources[].ties=drop)", flush=True)
        for split, chosen in splits.items():
            rendered = [p for r in chosen for p in render_pair(r, parts)] if pairs else \
                [render(r, parts) for r in chosen]
            if pairs:
                np.save(out / "tokens" / f"{source.name}.{split}.margin.npy",
                        np.array([r["margin"] for r in chosen], np.float32))
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
