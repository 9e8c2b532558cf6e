"""Generation for a decoder of models/common's blocks (the native Llama, the mixture of experts): a static-shape KV
cache in two compiled graphs, sampling in them. The model is a CausalLM (models/common/causal_lm.py) whose trunk
`model` has `tok_embeddings`, `layers` (each with its models/common/attention.py `attention`), the RoPE tables `cos`
and `set_rope_length`, and whose `cached(tokens, positions, bias, k_caches, v_caches, slot)` is the inference step.

    result = model.generate([[ids...], [ids...]], 128, SamplingOptions(temperature=0.8, top_p=0.95, seed=0), eos_id=3)

Device side (graph mode), through the model's `cached` (e.g. models/llama/model.py), in the model's compute dtype:
- **cache**: per layer K and V of [B, n_kv_heads, L, head_dim] (the kv heads: GQA is not repeated into the
  cache), L = P + max_new_tokens: Parameters of the two graphs below, written in place (graph inputs and outputs
  would copy the whole cache at every step: MindSpore's ops return new tensors). One set per (B, L), kept for the
  next call of that shape: B x L x 2 x layers x kv heads x head_dim numbers (16 MB at model=small, B 1, L 640).
- **two graphs**: `prefill` runs the whole left-padded prompt block [B, P] once and fills cache columns 0..P-1
  (the rest zeroed); `decode` runs one token [B, 1] and writes column t, chosen by a one-hot `slot` *tensor*.
  Every input is a tensor of a fixed shape (the column, positions and the attention bias too), so MindSpore
  compiles each graph once per (B, P, L) and the sampling steps the options use (Sampler), never per token or per
  option values (an input tensor). `Generator.compile_count` is the number of graphs MindSpore
  compiled (the sizes of the generation cells' compile caches).
- **sampling** (Sampler, the end of both graphs): repetition penalty (CTRL / Hugging Face rule, over the prompt and
  the tokens so far, a [B, vocab] mask kept on the device), then greedy (temperature 0) or temperature, top-k,
  top-p and an inverse-CDF draw. Each step reads back the [B] chosen tokens, not the [B, vocab] logits.
- **left padding**: prompts are right-aligned in the P columns, so every row's newest token is in the same
  column. `positions` start at 0 at each row's first real token (RoPE, `model.rope_scaling` tables included);
  the additive `bias` (0 allowed, -1e9 not) hides pad columns, the future, and not yet written cache columns.

Host side: the uniform draw of each row from `np.random.default_rng((seed, row))`, so a prompt's sample depends on
the seed and its index only (not on the batch it shares); a row ends at `eos_id`, at a stop string (the text is cut
before it) or after max_new_tokens; the loop ends when every row has.

MindFormers' logits processors (`mindformers.generation.logits_process`) are not used: importing them loads all of
MindFormers; their filters write -50000 rather than -inf, and their repetition penalty reads every id of the row,
which would count the left padding. Sampler follows Hugging Face's definitions instead (tests/test_generate.py
compares them).
"""
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from models.generation import GREEDY, SamplingOptions

NEG = -1e9  # the additive attention bias of a hidden column (as the training path's masks)
PROMPT_BUCKET = 16  # the padded prompt length P is rounded up to a multiple of this (fewer distinct graphs)


# --- results ---------------------------------------------------------------------------------------------------

def find_stop(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop string starts in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


@dataclass
class Sample:
    tokens: List[int]  # the new tokens (eos excluded; up to and including the one completing a stop string)
    finish_reason: str  # "eos" | "stop" | "length"
    text: Optional[str] = None  # decoded (cut before a stop string) when a `decode` function was given


@dataclass
class Generation:
    samples: List[Sample]
    logits: Optional[np.ndarray] = None  # [steps, B, vocab] raw model logits, with return_logits=True
    # compile_s (compiling the graphs this call needed first), prefill_s and decode_s (without compiling; decode_s:
    # the steps after the first), steps (sampling steps run: the longest row's new tokens), compile_count
    timings: dict = field(default_factory=dict)


# --- device side ----------------------------------------------------------------------------------------------

class Sampler(nn.Cell):
    """The next token of each row from the last column's logits [B, vocab] (fp32): the repetition penalty over
    `seen` [B, vocab] (the tokens of the prompt and so far), then the argmax (temperature 0) or the logits divided
    by the temperature, -inf outside the top_k largest (ties with the k-th kept) and outside the smallest most
    likely set reaching top_p (the first always kept), and an inverse-CDF draw at the row's `u` in (0, 1]: Hugging
    Face's RepetitionPenalty / TopK / TopP definitions.

    The option values are an input, `options` = float32 [temperature, top_k, top_p, repetition_penalty]
    (SamplingOptions.sampler_arguments), so they never make a new graph. Which steps run is a constant, each
    choice a graph variant compiled at its first use: `sampled` (else an argmax), `filtering` (top-k or top-p on;
    both thresholds from one descending sort of the vocabulary, top_k 0 or >= vocab and top_p 1 keeping every
    token) and `penalized` (the penalty, and the update of `seen` by the generation graph). Every op of the
    sampler is compiled again in each prefill and decode graph and run at every step, and MindSpore's CPU sort
    costs more than the rest of the sampler together, so a graph holds only the steps its options use: greedy
    without a penalty is the bare argmax."""

    def __init__(self, sampled: bool = False, filtering: bool = False, penalized: bool = False):
        super().__init__()
        self.sampled, self.filtering, self.penalized = sampled, filtering, penalized

    def filtered(self, logits, seen, options):
        """The logits the draw reads: penalized, and for sampling divided by the temperature and filtered."""
        if self.penalized:
            penalty = options[3]
            logits = ops.where(seen, ops.where(logits < 0, logits * penalty, logits / penalty), logits)
        if not self.sampled:
            return logits
        logits = logits / options[0]
        if not self.filtering:
            return logits
        batch, vocab = logits.shape
        ranked = ops.sort(logits, -1, descending=True)[0]
        top_k = options[1].astype(ms.int32)
        k = ops.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # off: the last (smallest) logit is the k-th
        kth = ops.gather_elements(ranked, 1, ops.broadcast_to(k.reshape(1, 1), (batch, 1)) - 1)
        ranked = ops.masked_fill(ranked, ranked < kth, float("-inf"))
        probs = ops.softmax(ranked, -1)
        before = ops.cumsum(probs, -1) - probs  # the probability of the better-ranked tokens
        kept = (before < options[2]).astype(ms.int32).sum(-1, keepdims=True)
        kept = ops.where(options[2] < 1, kept, vocab)  # top_p 1: every token, whatever the rounding of the sum
        threshold = ops.maximum(kth, ops.gather_elements(ranked, 1, kept - 1))
        return ops.masked_fill(logits, logits < threshold, float("-inf"))

    def construct(self, logits, seen, u, options):
        logits = self.filtered(logits, seen, options)
        if not self.sampled:
            return logits.argmax(-1).astype(ms.int32)
        cdf = ops.cumsum(ops.exp(logits - logits.max(-1, keepdims=True)), -1)
        chosen = (cdf < u.expand_dims(1) * cdf[:, -1:]).astype(ms.int32).sum(-1)  # u > 0: never a -inf token
        return ops.minimum(chosen, logits.shape[-1] - 1)


class _Graph(nn.Cell):
    """A generation graph around the model, ending in the sampler: (chosen tokens [B], logits [B, vocab]); the chosen
    tokens join `seen` when the repetition penalty reads it. MindSpore runs a compiled cell through Cell.__call__,
    which sets `compile_phase` on every call, and the stock setter walks every sub-cell: ~230 at model=small, 0.7 ms
    of a ~11 ms decoding step. Only the top cell's phase is read (mindspore/parallel/strategy.py), so it is kept here
    without the walk."""

    def __init__(self, lm, seen: Parameter, sampler: Sampler):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.lm, self.seen, self.sampler = lm, seen, sampler

    @property
    def compile_phase(self):
        return self._compile_phase

    @compile_phase.setter
    def compile_phase(self, value):
        self._compile_phase = value

    def pick(self, logits, u, options):
        chosen = self.sampler(logits, self.seen, u, options)
        if self.sampler.penalized:
            now = ops.arange(logits.shape[-1], dtype=ms.int32).expand_dims(0) == chosen.expand_dims(1)
            chosen = ops.depend(chosen, ops.assign(self.seen, ops.logical_or(self.seen, now)))
        return chosen, logits


class _Cached(_Graph):
    """A graph over the model's cached path and the KV caches it writes (ParameterTuples, see the module doc)."""

    def __init__(self, lm, seen: Parameter, sampler: Sampler, caches):
        super().__init__(lm, seen, sampler)
        self.k_caches, self.v_caches = caches


class _Prefill(_Cached):
    def construct(self, tokens, positions, bias, u, options):
        return self.pick(self.lm.cached(tokens, positions, bias, self.k_caches, self.v_caches), u, options)


class _Decode(_Cached):
    def construct(self, tokens, positions, bias, slot, u, options):
        return self.pick(self.lm.cached(tokens, positions, bias, self.k_caches, self.v_caches, slot), u, options)


class _Uncached(_Graph):
    """The baseline without a cache: the whole left-padded sequence so far, [B, L], every step."""

    def construct(self, tokens, positions, bias, u, options):
        return self.pick(self.lm.cached(tokens, positions, bias), u, options)


def _causal_bias(valid: np.ndarray) -> np.ndarray:
    """[B, 1, S, S] additive bias: column j visible to row i if j <= i and j holds a real token."""
    s = valid.shape[1]
    allowed = np.tril(np.ones((s, s), bool))[None] & valid[:, None, :]
    return np.where(allowed, 0.0, NEG).astype(np.float32)[:, None]


def _t(array, dtype=None) -> Tensor:
    return Tensor(np.ascontiguousarray(array), dtype)


class Generator:
    """The compiled graphs of one model (kept on it by `generator(model)`) and the decoding loop: the family's
    generator (models/generation.py says what callers use of it)."""

    prompt_bucket = PROMPT_BUCKET

    def __init__(self, model):
        self.model = model
        self.cached = {}  # (B, L) -> the K and V caches of that shape (ParameterTuples)
        self.cells = {}  # (kind, B, L, Sampler's sampled, filtering, penalized) -> its graph cell
        self.seen = {}  # B -> [B, vocab] bool Parameter: the tokens each row holds (the repetition penalty's)
        attention = model.model.layers[0].attention
        self.n_kv, self.head_dim, self.num_layers = attention.n_kv, attention.head_dim, len(model.model.layers)
        self.cache_dtype = attention.compute_dtype
        self.vocab = model.model.tok_embeddings.embedding_weight.shape[0]
        self.max_positions = model.model.cos.shape[0]
        self.compile_seconds = 0.0  # spent compiling graphs (the first call of each shape)
        self._seen = set()

    def graph(self, kind: str, batch: int, length: int, variant: tuple) -> _Graph:
        """The `kind` (prefill, decode, uncached) graph for `batch` rows and `length` cache columns, ending in the
        Sampler `variant` (sampled, filtering, penalized: the option values are an input), made at the first
        call; prefill and decode share the caches of a shape."""
        key = (kind, batch, length, *variant)
        if key in self.cells:
            return self.cells[key]
        args = (self.model, self.seen_of(batch), Sampler(*variant))
        if kind == "uncached":
            self.cells[key] = _Uncached(*args)
            return self.cells[key]
        if (batch, length) not in self.cached:
            shape = (batch, self.n_kv, length, self.head_dim)
            zeros = lambda name: Parameter(Tensor(np.zeros(shape, np.float32), self.cache_dtype), name,
                                           requires_grad=False)
            self.cached[batch, length] = [ParameterTuple(zeros(f"cache_{batch}x{length}.{which}.{i}")
                                                         for i in range(self.num_layers)) for which in "kv"]
        self.cells[key] = (_Prefill if kind == "prefill" else _Decode)(*args, self.cached[batch, length])
        return self.cells[key]

    def _sampler_inputs(self, sampling: SamplingOptions, prompts) -> tuple:
        """The options tensor and the Sampler variant of `sampling`; with a repetition penalty, `seen` set to the
        prompts' tokens (each graph adds the tokens it picks)."""
        temperature, top_k, top_p, penalty = sampling.sampler_arguments()
        if penalty != 1.0:
            seen = np.zeros((len(prompts), self.vocab), bool)
            for i, p in enumerate(prompts):
                seen[i, np.asarray(p)] = True
            self.seen_of(len(prompts)).set_data(Tensor(seen))
        options = _t(np.array([temperature, min(top_k, self.vocab), top_p, penalty], np.float32))
        return options, (temperature > 0, 0 < top_k < self.vocab or top_p < 1, penalty != 1.0)  # greedy: no filters

    def seen_of(self, batch: int) -> Parameter:
        """The [batch, vocab] mask of the tokens each row holds, shared by the graphs of `batch` rows."""
        if batch not in self.seen:
            self.seen[batch] = Parameter(Tensor(np.zeros((batch, self.vocab), bool)), f"seen_{batch}",
                                         requires_grad=False)
        return self.seen[batch]

    def _run(self, cell, *args):
        """cell(*args), compiled first (and timed) when these input shapes are new to it."""
        key = (id(cell),) + tuple(tuple(a.shape) for a in args)
        if key not in self._seen and ms.get_context("mode") == ms.GRAPH_MODE:
            start = time.perf_counter()
            cell.compile(*args)
            self.compile_seconds += time.perf_counter() - start
            self._seen.add(key)
        return cell(*args)

    @property
    def compile_count(self) -> int:
        """Graphs MindSpore has compiled for this model's generation cells (their compile caches)."""
        cells = list(self.cells.values())
        return sum(len(cell.compile_cache) for cell in cells)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingOptions = GREEDY, *,
                 eos_id: Optional[int] = None, stop: Sequence[str] = (),
                 decode: Optional[Callable[[List[int]], str]] = None, rows: Optional[Sequence[int]] = None,
                 prompt_len: Optional[int] = None, pad_id: int = 0, use_cache: bool = True,
                 return_logits: bool = False,
                 on_step: Optional[Callable[[int, List[List[int]], List[bool]], None]] = None) -> Generation:
        """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens, each chosen as `sampling`
        says (models/generation.py SamplingOptions: greedy by default).

        `stop` strings need `decode` (ids -> text; the new text is decode(prompt + new) after decode(prompt), so a
        leading space survives sentencepiece).
        `rows`: each prompt's index for its random stream (default 0..B-1); `prompt_len`: the padded prompt
        length P (default: the longest prompt rounded up to PROMPT_BUCKET), fixed by callers that want one pair
        of graphs for many batches. `use_cache=False` runs the uncached baseline (a full forward per token).
        `on_step(step, new, finished)` is called after each step with every row's new tokens so far."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop and decode is None:
            raise ValueError("stop strings need a decode function")
        tokens, valid, pads, width = self._layout(prompts, max_new_tokens, prompt_len, pad_id)
        batch, total = tokens.shape
        self.model.model.set_rope_length(total)  # dynamic NTK: one table for the whole cache (rope.py)
        options, variant = self._sampler_inputs(sampling, prompts)
        seed = sampling.seed if sampling.seed is not None else np.random.SeedSequence().entropy
        rngs = [np.random.default_rng([seed, r]) for r in (rows if rows is not None else range(batch))]
        columns = np.arange(total)

        def draws():  # each row's uniform draw in (0, 1] (never a zero-probability token); greedy reads none
            return _t(np.array([1.0 - rng.random() for rng in rngs] if variant[0] else np.ones(batch), np.float32))

        def positions(upto):  # [B, upto]: 0 at each row's first real token (pad columns: 0, never attended)
            return np.maximum(columns[None, :upto] - pads[:, None], 0).astype(np.int32)

        def full_forward(column):  # no cache: the sequence up to `column` moved to the right end, [B, L]
            shift = total - 1 - column
            moved = np.maximum(columns[None] - (pads + shift)[:, None], 0).astype(np.int32)
            return self._run(self.graph("uncached", batch, total, variant), _t(np.roll(tokens, shift, 1)),
                             _t(moved), _t(_causal_bias(np.roll(valid, shift, 1))), draws(), options)

        compiled_before, start = self.compile_seconds, time.perf_counter()
        if use_cache:
            prefill, step_graph = (self.graph(kind, batch, total, variant) for kind in ("prefill", "decode"))
            chosen, logits = self._run(prefill, _t(tokens[:, :width]), _t(positions(width)),
                                       _t(_causal_bias(valid[:, :width])), draws(), options)
        else:
            chosen, logits = full_forward(width - 1)
        chosen = chosen.asnumpy()
        prefill_s, prefill_compile = time.perf_counter() - start, self.compile_seconds - compiled_before
        rows = _Rows(prompts, max_new_tokens, eos_id, stop, decode)
        kept = [] if return_logits else None
        step = 0
        while True:
            if kept is not None:  # (the only read of the [B, vocab] logits)
                kept.append(logits.asnumpy())
            column = width + step  # where the chosen tokens go
            tokens[:, column], valid[:, column] = chosen, True
            rows.take(chosen)
            if on_step is not None:
                on_step(step, rows.new, list(rows.finished))
            step += 1
            if all(rows.finished) or step == max_new_tokens:
                break
            bias = np.where(valid, 0.0, NEG).astype(np.float32)[:, None, None, :]  # [B, 1, 1, L]
            if use_cache:
                slot = (columns == column)[None, None, :, None]
                chosen, logits = self._run(step_graph, _t(tokens[:, column:column + 1]),
                                           _t((column - pads)[:, None].astype(np.int32)), _t(bias), _t(slot), draws(),
                                           options)
            else:
                chosen, logits = full_forward(column)
            chosen = chosen.asnumpy()
        compile_s = self.compile_seconds - compiled_before
        timings = {"compile_s": compile_s, "prefill_s": prefill_s - prefill_compile,
                   "decode_s": time.perf_counter() - start - prefill_s - (compile_s - prefill_compile),
                   "steps": step, "compile_count": self.compile_count}
        return Generation(rows.samples(), np.stack(kept) if kept is not None else None, timings)

    def _layout(self, prompts, max_new_tokens: int, prompt_len: Optional[int], pad_id: int):
        """The whole sequence's tokens [B, L] (each prompt left-padded to the prompt width P, then room for the new
        tokens), which of them are real, each row's padding and P; one clear error for prompts that do not fit."""
        lengths = np.array([len(p) for p in prompts])
        if len(prompts) == 0 or lengths.min() < 1:
            raise ValueError("every prompt needs at least one token")
        if lengths.max() + max_new_tokens > self.max_positions:
            raise ValueError(f"prompt ({lengths.max()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context (max_position_embeddings={self.max_positions})")
        width = prompt_len or -(-int(lengths.max()) // PROMPT_BUCKET) * PROMPT_BUCKET
        if width < lengths.max():
            raise ValueError(f"prompt_len={width} is shorter than the longest prompt ({lengths.max()} tokens)")
        total = width + max_new_tokens  # cache columns L
        pads = width - lengths
        tokens = np.full((len(prompts), total), pad_id, np.int32)
        valid = np.zeros((len(prompts), total), bool)
        for i, p in enumerate(prompts):
            tokens[i, pads[i]:width] = p
            valid[i, pads[i]:width] = True
        return tokens, valid, pads, width


class _Rows:
    """Each row's new tokens, whether it has finished and why, as Generator.generate's steps pick them."""

    def __init__(self, prompts, max_new_tokens: int, eos_id: Optional[int], stop: Sequence[str],
                 decode: Optional[Callable[[List[int]], str]]):
        self.prompts, self.max_new_tokens, self.eos_id, self.stop, self.decode = (
            prompts, max_new_tokens, eos_id, stop, decode)
        self.new: List[List[int]] = [[] for _ in prompts]
        self.finished, self.reasons = [False] * len(prompts), ["length"] * len(prompts)
        self.texts: List[Optional[str]] = [None] * len(prompts)
        self.prefixes = [decode(list(p)) for p in prompts] if decode is not None else None

    def continuation(self, i: int) -> str:
        """The text of row i's new tokens."""
        full = self.decode(list(self.prompts[i]) + self.new[i])
        return full[len(self.prefixes[i]):] if full.startswith(self.prefixes[i]) else self.decode(self.new[i])

    def take(self, chosen: np.ndarray) -> None:
        """One step's tokens [B]: appended to the rows still running, which end at eos, a stop string or the
        length."""
        for i, token in enumerate(chosen):
            if self.finished[i]:
                continue
            if self.eos_id is not None and token == self.eos_id:
                self.finished[i], self.reasons[i] = True, "eos"
                continue
            self.new[i].append(int(token))
            if self.stop:
                text = self.continuation(i)
                cut = find_stop(text, self.stop)
                if cut >= 0:
                    self.finished[i], self.reasons[i], self.texts[i] = True, "stop", text[:cut]
            if len(self.new[i]) == self.max_new_tokens:
                self.finished[i] = True

    def samples(self) -> List[Sample]:
        return [Sample(self.new[i], self.reasons[i], self.texts[i] if self.texts[i] is not None else
                       (self.continuation(i) if self.decode is not None else None)) for i in range(len(self.new))]


def generator(model) -> Generator:
    """The model's Generator, made once (its compiled graphs are reused by later calls of the same shapes)."""
    gen = model.__dict__.get("_generator")
    if gen is None:
        gen = Generator(model)
        object.__setattr__(model, "_generator", gen)  # a plain attribute: not a sub-cell, no parameter renames
    return gen
