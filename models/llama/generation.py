"""Generation for the native Llama: a static-shape KV cache in two compiled graphs, decoding on the host.

    result = model.generate([[ids...], [ids...]], 128, temperature=0.8, top_p=0.95, eos_id=3, seed=0)

Device side (graph mode), through `LlamaForCausalLM.cached` (models/llama/model.py):
- **cache**: per layer K and V of [B, n_kv_heads, L, head_dim] (the kv heads: GQA is not repeated into the
  cache), L = P + max_new_tokens: Parameters of the two graphs below, written in place. A step writes one
  column; passed as graph inputs and outputs, as before the twenty-first pass, the caches were copied whole at
  every step (MindSpore's ops return new tensors). One set per (B, L), kept with its graphs for the next call of
  that shape: B x L x 2 x layers x kv heads x head_dim numbers (16 MB at model=small, B 1, L 640).
- **two graphs**: `prefill` runs the whole left-padded prompt block [B, P] once and fills cache columns 0..P-1
  (the rest zeroed); `decode` runs one token [B, 1] and writes column t, chosen by a one-hot `slot` *tensor*.
  Every input is a tensor of a fixed shape (the column, positions and the attention bias too), so MindSpore
  compiles each graph once per (B, P, L) and never per token. `Generator.compile_count` is the number of graphs
  MindSpore compiled (the sizes of the generation cells' compile caches).
- **left padding**: prompts are right-aligned in the P columns, so every row's newest token is in the same
  column. `positions` start at 0 at each row's first real token (RoPE, `model.rope_scaling` tables included);
  the additive `bias` (0 allowed, -1e9 not) hides pad columns, the future, and not yet written cache columns.

Host side (NumPy, per step on the [B, vocab] logits): repetition penalty (CTRL / Hugging Face rule, over the
prompt and the tokens so far), then greedy (temperature 0) or temperature, top-k, top-p, and a draw from
`np.random.default_rng((seed, row))` per row, so a prompt's sample depends on the seed and its index only
(not on the batch it shares). A row ends at `eos_id`, at a stop string (the text is cut before it) or after
max_new_tokens; the loop ends when every row has.

MindFormers' NumPy logits processors (`mindformers.generation.logits_process`) are not used: importing them
loads all of MindFormers; their `__call__` runs MindSpore ops unless a MindFormers context asks for NumPy;
their filters write -50000 rather than -inf, and their repetition penalty reads every id of the row, which
would count the left padding. The ~40 lines below follow Hugging Face's definitions instead.
"""
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn

NEG = -1e9  # the additive attention bias of a hidden column (as the training path's masks)
PROMPT_BUCKET = 16  # the padded prompt length P is rounded up to a multiple of this (fewer distinct graphs)


# --- host-side decoding ---------------------------------------------------------------------------------------

def check_options(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                  max_new_tokens: int = 1) -> None:
    """ValueError naming the option for values outside their ranges."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1: off), got {repetition_penalty}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def penalize_repetition(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Logits of tokens already in the row (`seen` [B, V] bool) divided by `penalty` if positive, multiplied
    if negative (Keskar et al. 2019, as Hugging Face's RepetitionPenaltyLogitsProcessor)."""
    if penalty == 1.0:
        return logits
    return np.where(seen, np.where(logits < 0, logits * penalty, logits / penalty), logits)


def filter_top_k_top_p(logits: np.ndarray, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """-inf outside the k largest logits and outside the smallest set of most likely tokens whose probability
    reaches top_p (the most likely token always stays)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(logits, vocab - top_k, axis=-1)[:, vocab - top_k, None]
        logits = np.where(logits < kth, -np.inf, logits)
    if top_p < 1.0:
        order = np.argsort(-logits, axis=-1, kind="stable")
        ranked = np.take_along_axis(logits, order, -1)
        probs = np.exp(ranked - ranked[:, :1])
        probs /= probs.sum(-1, keepdims=True)
        before = np.cumsum(probs, -1) - probs  # probability of the better-ranked tokens
        drop = np.zeros_like(before, dtype=bool)
        np.put_along_axis(drop, order, before >= top_p, -1)
        logits = np.where(drop, -np.inf, logits)
    return logits


def choose(logits: np.ndarray, rngs: Sequence[np.random.Generator], temperature: float, top_k: int,
           top_p: float) -> np.ndarray:
    """Next token per row: argmax for temperature 0, else a draw from softmax(filtered logits / temperature)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = filter_top_k_top_p(logits.astype(np.float64) / temperature, top_k, top_p)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    cdf = np.cumsum(probs, -1)
    u = np.array([1.0 - rng.random() for rng in rngs])  # (0, 1]: never lands on a zero-probability token
    return np.minimum((cdf < u[:, None] * cdf[:, -1:]).sum(-1), logits.shape[-1] - 1)


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

class _Graph(nn.Cell):
    """A generation graph around the model. MindSpore runs a compiled cell through Cell.__call__, which sets
    `compile_phase` on every call, and the stock setter walks every sub-cell: ~230 at model=small, 0.7 ms of a
    ~11 ms decoding step. Only the top cell's phase is read (mindspore/parallel/strategy.py), so it is kept here
    without the walk."""

    def __init__(self, lm):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.lm = lm

    @property
    def compile_phase(self):
        return self._compile_phase

    @compile_phase.setter
    def compile_phase(self, value):
        self._compile_phase = value


class _Cached(_Graph):
    """A graph over the model's cached path and the KV caches it writes (ParameterTuples, see the module doc)."""

    def __init__(self, lm, k_caches: ParameterTuple, v_caches: ParameterTuple):
        super().__init__(lm)
        self.k_caches, self.v_caches = k_caches, v_caches


class _Prefill(_Cached):
    def construct(self, tokens, positions, bias):
        return self.lm.cached(tokens, positions, bias, self.k_caches, self.v_caches)


class _Decode(_Cached):
    def construct(self, tokens, positions, bias, slot):
        return self.lm.cached(tokens, positions, bias, self.k_caches, self.v_caches, slot)


class _Uncached(_Graph):
    """The baseline without a cache: the whole left-padded sequence so far, [B, L], every step."""

    def construct(self, tokens, positions, bias):
        return self.lm.cached(tokens, positions, bias)


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
        self.uncached = _Uncached(model)
        self.cached = {}  # (B, L) -> (prefill, decode): the graphs sharing that shape's caches
        attention = model.model.layers[0].attention
        self.n_kv, self.head_dim, self.num_layers = attention.n_kv, attention.head_dim, len(model.model.layers)
        self.cache_dtype = attention.compute_dtype
        self.max_positions = model.model.cos.shape[0]
        self.compile_seconds = 0.0  # spent compiling graphs (the first call of each shape)
        self._seen = set()

    def graphs(self, batch: int, length: int):
        """(prefill, decode) over the caches of `batch` rows and `length` columns, made at the first call."""
        if (batch, length) not in self.cached:
            shape = (batch, self.n_kv, length, self.head_dim)
            caches = [ParameterTuple(Parameter(Tensor(np.zeros(shape, np.float32), self.cache_dtype),
                                               f"cache_{batch}x{length}.{kind}.{i}", requires_grad=False)
                                     for i in range(self.num_layers)) for kind in "kv"]
            self.cached[batch, length] = _Prefill(self.model, *caches), _Decode(self.model, *caches)
        return self.cached[batch, length]

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
        cells = [self.uncached] + [cell for pair in self.cached.values() for cell in pair]
        return sum(len(cell.compile_cache) for cell in cells)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, eos_id: Optional[int] = None,
                 stop: Sequence[str] = (), decode: Optional[Callable[[List[int]], str]] = None,
                 seed: Optional[int] = None, rows: Optional[Sequence[int]] = None, prompt_len: Optional[int] = None,
                 pad_id: int = 0, use_cache: bool = True, return_logits: bool = False,
                 on_step: Optional[Callable[[int, List[List[int]], List[bool]], None]] = None) -> Generation:
        """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

        temperature 0 is greedy; top_k 0 and top_p 1 are off. `stop` strings need `decode` (ids -> text; the
        new text is decode(prompt + new) after decode(prompt), so a leading space survives sentencepiece).
        `rows`: each prompt's index for its random stream (default 0..B-1); `prompt_len`: the padded prompt
        length P (default: the longest prompt rounded up to PROMPT_BUCKET), fixed by callers that want one pair
        of graphs for many batches. `use_cache=False` runs the uncached baseline (a full forward per token).
        `on_step(step, new, finished)` is called after each step with every row's new tokens so far."""
        check_options(temperature, top_k, top_p, repetition_penalty, max_new_tokens)
        if stop and decode is None:
            raise ValueError("stop strings need a decode function")
        lengths = np.array([len(p) for p in prompts])
        if len(prompts) == 0 or lengths.min() < 1:
            raise ValueError("every prompt needs at least one token")
        if lengths.max() + max_new_tokens > self.max_positions:
            raise ValueError(f"prompt ({lengths.max()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context (max_position_embeddings={self.max_positions})")
        batch = len(prompts)
        width = prompt_len or -(-int(lengths.max()) // PROMPT_BUCKET) * PROMPT_BUCKET
        if width < lengths.max():
            raise ValueError(f"prompt_len={width} is shorter than the longest prompt ({lengths.max()} tokens)")
        total = width + max_new_tokens  # cache columns L
        self.model.model.set_rope_length(total)  # dynamic NTK: one table for the whole cache (rope.py)
        pads = width - lengths
        tokens = np.full((batch, total), pad_id, np.int32)  # the whole sequence, left-padded
        valid = np.zeros((batch, total), bool)
        for i, p in enumerate(prompts):
            tokens[i, pads[i]:width] = p
            valid[i, pads[i]:width] = True
        vocab = self.model.model.tok_embeddings.embedding_weight.shape[0]
        seen = np.zeros((batch, vocab), bool)
        for i, p in enumerate(prompts):
            seen[i, np.asarray(p)] = True
        seed = seed if seed is not None else np.random.SeedSequence().entropy
        rngs = [np.random.default_rng([seed, r]) for r in (rows if rows is not None else range(batch))]
        columns = np.arange(total)

        def positions(upto):  # [B, upto]: 0 at each row's first real token (pad columns: 0, never attended)
            return np.maximum(columns[None, :upto] - pads[:, None], 0).astype(np.int32)

        def full_forward(column):  # no cache: the sequence up to `column` moved to the right end, [B, L]
            shift = total - 1 - column
            moved = np.maximum(columns[None] - (pads + shift)[:, None], 0).astype(np.int32)
            return self._run(self.uncached, _t(np.roll(tokens, shift, 1)), _t(moved),
                             _t(_causal_bias(np.roll(valid, shift, 1))))

        compiled_before, start = self.compile_seconds, time.perf_counter()
        if use_cache:
            prefill, step_graph = self.graphs(batch, total)
            logits = self._run(prefill, _t(tokens[:, :width]), _t(positions(width)), _t(_causal_bias(valid[:, :width])))
        else:
            logits = full_forward(width - 1)
        logits = logits.asnumpy()
        prefill_s, prefill_compile = time.perf_counter() - start, self.compile_seconds - compiled_before
        new: List[List[int]] = [[] for _ in range(batch)]
        finished, reasons = [False] * batch, ["length"] * batch
        texts: List[Optional[str]] = [None] * batch
        prefixes = [decode(list(p)) for p in prompts] if decode is not None else None

        def continuation(i):  # the text of row i's new tokens
            full = decode(list(prompts[i]) + new[i])
            return full[len(prefixes[i]):] if full.startswith(prefixes[i]) else decode(new[i])

        kept = [] if return_logits else None
        step = 0
        while True:
            if kept is not None:
                kept.append(logits)
            logits = penalize_repetition(logits, seen, repetition_penalty)
            chosen = choose(logits, rngs, temperature, top_k, top_p).astype(np.int32)
            column = width + step  # where the chosen tokens go
            tokens[:, column], valid[:, column] = chosen, True
            seen[np.arange(batch), chosen] = True
            for i in range(batch):
                if finished[i]:
                    continue
                if eos_id is not None and chosen[i] == eos_id:
                    finished[i], reasons[i] = True, "eos"
                    continue
                new[i].append(int(chosen[i]))
                if stop:
                    text = continuation(i)
                    cut = find_stop(text, stop)
                    if cut >= 0:
                        finished[i], reasons[i], texts[i] = True, "stop", text[:cut]
                if len(new[i]) == max_new_tokens:
                    finished[i] = True
            if on_step is not None:
                on_step(step, new, list(finished))
            step += 1
            if all(finished) or step == max_new_tokens:
                break
            bias = np.where(valid, 0.0, NEG).astype(np.float32)[:, None, None, :]  # [B, 1, 1, L]
            if use_cache:
                slot = (columns == column)[None, None, :, None]
                logits = self._run(step_graph, _t(tokens[:, column:column + 1]),
                                   _t((column - pads)[:, None].astype(np.int32)), _t(bias), _t(slot))
            else:
                logits = full_forward(column)
            logits = logits.asnumpy()
        samples = []
        for i in range(batch):
            text = texts[i] if texts[i] is not None else (continuation(i) if decode is not None else None)
            samples.append(Sample(new[i], reasons[i], text))
        compile_s = self.compile_seconds - compiled_before
        timings = {"compile_s": compile_s, "prefill_s": prefill_s - prefill_compile,
                   "decode_s": time.perf_counter() - start - prefill_s - (compile_s - prefill_compile),
                   "steps": step, "compile_count": self.compile_count}
        return Generation(samples, np.stack(kept) if kept is not None else None, timings)


def generator(model) -> Generator:
    """The model's Generator, made once (its compiled graphs are reused by later calls of the same shapes)."""
    gen = model.__dict__.get("_generator")
    if gen is None:
        gen = Generator(model)
        object.__setattr__(model, "_generator", gen)  # a plain attribute: not a sub-cell, no parameter renames
    return gen
