"""Sample text from a mindlab checkpoint or a Hugging Face Llama directory, through the model family's generator
(models/generation.py; Llama's: a KV cache in two compiled graphs).

    python -m generate runs/a/checkpoints/step_000400 --prompt "def fibonacci(n):" --max-new-tokens 128 \\
        --temperature 0.8 --top-p 0.95 [--top-k 50] [--repetition-penalty 1.1] [--stop "\\n\\n" ...] [--seed 0]
    python -m generate runs/a/checkpoints/step_000400 --prompts-file prompts.jsonl --out samples.jsonl --batch-size 8
    python -m generate out/hf_model --prompt "To be, or not to be" --temperature 0     # greedy

SOURCE is a checkpoint directory (config.yaml + model.safetensors + tokenizer.model; a run's `checkpoints/`
or run directory follows `latest`) or a Hugging Face Llama directory (config.json + *.safetensors +
tokenizer.model), imported through `models.convert.import_hf` into a temporary directory first. One prompt is
streamed to stdout as it is generated; `--instruction` is wrapped in the checkpoint's template first (data.template,
as its SFT rendered it). A prompts file (one JSON object per line: {"prompt": ...} as it is, {"instruction": ...,
"input": ...} or {"messages": [...]} in the template; other keys kept) gives one JSON line per prompt, in order:
{..., "prompt" (the text the model saw), "completion", "finish_reason", "new_tokens"}. All
batches share one padded prompt length and batch size (the last batch is filled up), so the whole run
compiles two graphs. Temperature 0 is greedy. Bad input prints one `error: ...` line and exits with code 2
(1 for a checkpoint that cannot be loaded).
"""
import boot  # noqa: F401  (first: imports MindSpore before anything that loads protobuf)

import json
import os
import re
import sys
import tempfile
import time
from typing import List, Optional

from argparse import RawDescriptionHelpFormatter

from omegaconf import OmegaConf

from base.errors import ArgumentParser, UsageError, entry_point
from base.schema import as_device
from models.generation import SamplingOptions
from models.pretrained import build, graph_mode, load


def parse_args(argv: Optional[List[str]]):
    parser = ArgumentParser(prog="python -m generate", description=__doc__,
                            formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="CKPT_OR_HF_DIR", help="mindlab checkpoint dir or Hugging Face Llama dir")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt, as it is (streamed to stdout)")
    prompts.add_argument("--instruction", help="one instruction, wrapped in the checkpoint's own template (data."
                         "template: the prompt its SFT trained it to answer after; streamed to stdout)")
    prompts.add_argument("--prompts-file", help="JSONL, one object per line: {\"prompt\": ...} as it is, "
                         "{\"instruction\": ...[, \"input\": ...]} or {\"messages\": [{\"role\", \"content\"}, ...]} "
                         "in the checkpoint's template")
    parser.add_argument("--template", choices=("alpaca", "alpaca_zh", "chatml"), help="wrap --instruction and chats "
                        "in this built-in template (data/samples.py TEMPLATES) instead of the checkpoint's own (said on "
                        "stderr)")
    parser.add_argument("--out", help="write the samples here as JSONL (default: stdout for a prompts file)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (1: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0 (1: off)")
    parser.add_argument("--stop", nargs="+", default=[], metavar="STR",
                        help=r"end a sample at any of these strings (cut before it); \n, \t and \\ are escapes")
    parser.add_argument("--ignore-eos", action="store_true", help="do not end samples at the eos token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="CPU", help="MindSpore device target (CPU, Ascend, GPU)")
    parser.add_argument("--precision", choices=("auto", "fp32", "fp16", "bf16"), default="auto",
                        help="compute dtype (auto: fp32 on CPU, bf16 on Ascend/GPU, as the device presets)")
    args = parser.parse_args(argv)
    checks = [(args.max_new_tokens >= 1, "--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}"),
              (args.temperature >= 0, "--temperature", f"must be >= 0 (0: greedy), got {args.temperature}"),
              (0 < args.top_p <= 1, "--top-p", f"must be in (0, 1], got {args.top_p}"),
              (args.top_k >= 0, "--top-k", f"must be >= 0 (0: off), got {args.top_k}"),
              (args.repetition_penalty > 0, "--repetition-penalty", f"must be > 0, got {args.repetition_penalty}"),
              (args.batch_size >= 1, "--batch-size", f"must be >= 1, got {args.batch_size}"),
              (all(args.stop), "--stop", "stop strings cannot be empty"),
              (args.precision != "bf16" or as_device(args.device).bf16, "--precision",
               "bf16 needs Ascend/GPU (MindSpore's CPU kernels have no bf16 matmul); use fp32 or fp16 on CPU"),
              (not args.out or os.path.isdir(os.path.dirname(os.path.abspath(args.out))), "--out",
               f"no such directory: {os.path.dirname(os.path.abspath(args.out or '.'))}")]
    args.stop = [unescape(s) for s in args.stop]
    for ok, name, message in checks:
        if not ok:
            raise UsageError(f"{name}: {message}")
    return args


def unescape(text: str) -> str:
    """\\n, \\t and \\\\ in a command-line string (a shell passes them as two characters)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def read_prompts(args) -> List[dict]:
    """[{"prompt" | "instruction" | "messages": ..., ...}] with `where` (the argument or file:line) for errors."""
    for flag, key in (("--prompt", "prompt"), ("--instruction", "instruction")):
        value = getattr(args, key)
        if value is not None:
            if not value:
                raise UsageError(f"{flag}: the {key} is empty")
            return [{key: value, "where": flag}]
    if not os.path.isfile(args.prompts_file):
        raise UsageError(f"--prompts-file: no such file: {args.prompts_file}")
    records = []
    with open(args.prompts_file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            where = f"{args.prompts_file}:{number}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{where}: not a JSON object ({err})") from None
            kinds = [k for k in ("prompt", "instruction", "messages") if isinstance(record, dict) and k in record]
            if len(kinds) != 1 or not isinstance(record[kinds[0]], list if kinds[0] == "messages" else str):
                raise UsageError(f'{where}: needs one of a "prompt" or an "instruction" string, or a "messages" list, '
                                 'as {"instruction": "..."}')
            if not record[kinds[0]]:
                raise UsageError(f"{where}: the {kinds[0]} is empty")
            if kinds[0] == "messages" and not all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                                                  and isinstance(m.get("content"), str) for m in record["messages"]):
                raise UsageError(f'{where}: each message needs a "role" (system, user or assistant) and a "content" '
                                 "string")
            records.append({**record, "where": where})
    if not records:
        raise UsageError(f"{args.prompts_file}: no prompts in the file")
    return records


def encode_prompts(records, tokenizer, context: int, max_new_tokens: int, template: dict) -> List[List[int]]:
    """Token ids per prompt, checked against the model's context (max_position_embeddings). An instruction or a
    chat is wrapped in `template` first, as training rendered it (its text becomes the record's "prompt")."""
    from data.samples import encode_parts, prompt_parts

    encoded = []
    for r in records:
        if "prompt" in r:
            ids = tokenizer.encode(r["prompt"])
        else:
            parts = prompt_parts(r, template)
            ids = encode_parts(tokenizer, parts)[0]
            r["prompt"] = "".join(text for text, _ in parts if text is not None)
        if not ids:
            raise UsageError(f"{r['where']}: the prompt encodes to no tokens")
        if len(ids) > context:
            raise UsageError(f"{r['where']}: the prompt is {len(ids)} tokens, longer than the model's context "
                             f"(max_position_embeddings={context})")
        if len(ids) + max_new_tokens > context:
            raise UsageError(f"--max-new-tokens: {max_new_tokens} new tokens after the {len(ids)}-token prompt of "
                             f"{r['where']} overflow the model's context (max_position_embeddings={context}); "
                             f"at most {context - len(ids)} fit")
        encoded.append(ids)
    return encoded


class Stream:
    """Prints row 0's text as it grows, holding back what could still become a stop string (`decode_row` leaves
    out a partial UTF-8 character: Tokenizer.whole_chars)."""

    def __init__(self, decode_row, stops):
        self.decode_row, self.shown = decode_row, 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def __call__(self, step, new, finished):
        if finished[0]:
            return
        text = self.decode_row(new[0])
        self.emit(text[:max(len(text) - self.hold, 0)])

    def emit(self, text):
        if len(text) > self.shown:
            sys.stdout.write(text[self.shown:])
            sys.stdout.flush()
            self.shown = len(text)


@entry_point
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    records = read_prompts(args)
    with tempfile.TemporaryDirectory(prefix="mindlab-generate-") as workdir:
        model_cfg, path, tokenizer = load(args.source, workdir)
        from data.samples import template_of

        template = template_of(OmegaConf.load(os.path.join(path, "config.yaml")), args.template)
        prompts = encode_prompts(records, tokenizer, model_cfg.max_position_embeddings, args.max_new_tokens, template)
        if template["assistant_end"] and any("instruction" in r or "messages" in r for r in records):
            args.stop = args.stop + [template["assistant_end"]]  # a templated answer ends with it, then eos
        graph_mode(args.device)
        model = build(model_cfg, path, args.device, args.precision)  # reads the weights: the temp dir may go
    from models.generation import generator

    run(args, generator(model_cfg.family, model), tokenizer, records, prompts)
    return 0


def run(args, gen, tokenizer, records, prompts) -> None:
    """Generate for every prompt with the family's generator `gen`, streaming one prompt or writing JSONL."""
    eos_id = None if args.ignore_eos else tokenizer.eos_id
    bucket = gen.prompt_bucket
    width = -(-max(len(p) for p in prompts) // bucket) * bucket  # one prompt length for all batches
    batch_size = min(args.batch_size, len(prompts))
    single = args.prompt is not None or args.instruction is not None
    out = open(args.out, "w", encoding="utf-8") if args.out else (None if single else sys.stdout)
    sampling = SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               repetition_penalty=args.repetition_penalty, seed=args.seed)
    options = dict(eos_id=eos_id, stop=args.stop, decode=lambda ids: tokenizer.decode(tokenizer.whole_chars(ids)),
                   prompt_len=width)
    start, new_tokens, decode_s, decode_steps = time.perf_counter(), 0, 0.0, 0
    try:
        for first in range(0, len(prompts), batch_size):
            rows = list(range(first, min(first + batch_size, len(prompts))))
            filler = [rows[0]] * (batch_size - len(rows))  # the last batch filled up: same shapes, same graphs
            stream = None
            if single:
                prefix = tokenizer.decode(prompts[0])
                stream = Stream(lambda ids: options["decode"](prompts[0] + ids)[len(prefix):], args.stop)
                sys.stdout.write(records[0]["prompt"])
                sys.stdout.flush()
            result = gen.generate([prompts[r] for r in rows + filler], args.max_new_tokens, sampling,
                                  rows=rows + filler, on_step=stream, **options)
            for r, sample in zip(rows, result.samples):
                new_tokens += len(sample.tokens)
                if stream is not None:
                    stream.emit(sample.text)
                    sys.stdout.write("\n")
                if out is not None:
                    record = {k: v for k, v in records[r].items() if k != "where"}
                    out.write(json.dumps({**record, "completion": sample.text, "finish_reason": sample.finish_reason,
                                          "new_tokens": len(sample.tokens)}, ensure_ascii=False) + "\n")
                    out.flush()
            decode_s += result.timings["decode_s"]
            decode_steps += max(result.timings["steps"] - 1, 0)
    finally:
        if out is not None and out is not sys.stdout:
            out.close()
    rate = f", decode {decode_steps * batch_size / decode_s:.1f} tokens/s" if decode_s > 0 else ""
    print(f"[generate] {len(prompts)} prompt(s), {new_tokens} new tokens in {time.perf_counter() - start:.1f} s"
          f"{rate} (batch {batch_size}); {gen.compile_count} graphs compiled in {gen.compile_seconds:.1f} s"
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
