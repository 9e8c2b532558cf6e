"""Text generation, whatever the family: a family that generates exposes `generator(model)` in its package
(models/<family>/__init__.py), the model's generator, made once per model (its compiled graphs are reused):

    gen.generate(prompts, max_new_tokens, sampling, **options) -> result   prompts: lists of token ids;
                          result.samples: [Sample(tokens, finish_reason, text)], result.timings; sampling: a
                          SamplingOptions (below; greedy by default); options: eos_id, stop (strings, with
                          decode), decode, rows (each prompt's random stream), prompt_len (the padded prompt
                          length), on_step
    gen.prompt_bucket     padded prompt lengths are rounded up to a multiple of this (fewer distinct graphs)
    gen.max_positions     the longest prompt + new tokens it serves
    gen.compile_count, gen.compile_seconds

Llama's is models/common/generation.py (a KV cache in two compiled graphs). `make_generate_fn` turns any
generator into the text-level function that evaluation tasks, harness.py and on-policy preference pairs call.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional

from models import family


@dataclass(frozen=True)
class SamplingOptions:
    """How each row's next token is chosen: greedy at temperature 0, else drawn from the logits divided by the
    temperature, top_k 0 and top_p 1 being off; repetition_penalty (1: off) applies either way (Hugging Face's
    definitions). `seed` starts each row's random stream (None: fresh entropy). Out-of-range values are a
    ValueError naming the option, at construction."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}")

    def sampler_arguments(self) -> tuple:
        """(temperature, top_k, top_p, repetition_penalty) as the compiled sampler's input takes them: greedy ignores
        the filters, so greedy runs in the graph without them whatever top_k and top_p say."""
        if not self.temperature:
            return 0.0, 0, 1.0, self.repetition_penalty
        return self.temperature, self.top_k, self.top_p, self.repetition_penalty


GREEDY = SamplingOptions()


def generates(family_name: str) -> bool:
    """Whether the family has a generator hook."""
    return family(family_name).generator is not None


def generator(family_name: str, model):
    """The family's generator of `model`, or None for a family without one (BERT)."""
    return family(family_name).generator(model) if generates(family_name) else None


def make_generate_fn(gen, tokenizer, batch_size: int = 16) -> Callable[..., List[str]]:
    """generate_fn(prompts: list[str], max_new_tokens, rows=None, prompt_len=None, **options) -> list[str], the
    new text of each prompt (without it), stopping at eos; `options` are the generator's (`sampling`, a
    SamplingOptions: greedy by default; `stop` strings cut the text before them). Prompts longer than the context
    are cut on the left so that they and the new tokens fit.

    The prompts run `batch_size` at a time, all padded to `prompt_len` (default: the longest prompt's bucket)
    and the last batch filled up with copies of its last prompt, so one pair of graphs serves every batch. Prompt
    i samples from random stream rows[i] (default i), so sampling does not depend on the batching. One batch of
    all prompts would hold their [B, P, vocab] prefill logits and [B, heads, P, P] scores at once: 200 prompts
    at model=small took the box's 24 GB."""

    def generate_fn(prompts, max_new_tokens: int, rows: Optional[List[int]] = None, prompt_len: Optional[int] = None,
                    **options) -> List[str]:
        room = gen.max_positions - max_new_tokens
        ids = [(tokenizer.encode(p) or [tokenizer.eos_id])[-room:] for p in prompts]
        rows = list(range(len(ids)) if rows is None else rows)
        bucket = gen.prompt_bucket
        width = prompt_len or min(-(-max(map(len, ids)) // bucket) * bucket, room)
        size, texts = min(batch_size, len(ids)), []
        for start in range(0, len(ids), size):
            chunk, chunk_rows = ids[start:start + size], rows[start:start + size]
            fill = size - len(chunk)
            out = gen.generate(chunk + chunk[-1:] * fill, max_new_tokens, eos_id=tokenizer.eos_id,
                               decode=tokenizer.decode, rows=chunk_rows + chunk_rows[-1:] * fill, prompt_len=width,
                               **options)
            texts += [sample.text for sample in out.samples[:len(chunk)]]
        return texts

    return generate_fn
