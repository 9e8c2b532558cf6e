"""Generation with a KV cache (models/common/generation.py) and `python -m generate`: cached logits equal the
training path's, greedy tokens equal transformers', sampling options, two compiled graphs, the CLI."""
import json
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

import mindspore as ms
from mindspore import Tensor

import generate as cli
from adapters.twins import libraries_in
from base import checkpoint
from conftest import ROOT, built_kernel, load_preset
from data.tokenizer import Tokenizer
from helpers import one_torch_thread
from models import build_model
from models.convert import export_hf, main as cli_convert
from models.common.generation import Generator, Sampler
from models.generation import SamplingOptions

LINES = ["To be, or not to be, that is the question:", "Shall I compare thee to a summer's day?",
         "Now is the winter of our discontent", "Friends, Romans, countrymen, lend me your ears;"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer_file):
    """A random-init tiny Llama (GQA 4/2 heads) saved as a checkpoint with the real tokenizer. init_std 0.1
    (not 0.02) so that greedy continuations do not collapse into one repeated token."""
    cfg = OmegaConf.merge(load_preset("model", "tiny"), {"init_std": 0.1})
    model = build_model(cfg, 64, "fp32", "CPU", seed=3)
    path = checkpoint.save(str(tmp_path_factory.mktemp("generate") / "ckpt"), 1, model,
                           ms.nn.SGD(model.trainable_params()), {}, OmegaConf.create({"model": cfg}), tokenizer_file)
    return model, path, Tokenizer(tokenizer_file)


def two_prompts(tok):
    return [tok.encode(LINES[0]), tok.encode(LINES[1][:12])]  # different lengths: left padding


@pytest.fixture(scope="module")
def gen32(ckpt):
    """A fresh Generator of the model (its own compile caches), used with 32 new tokens after the 16-column prompt
    bucket: one pair of graphs [2, 16] / [2, 1] per sampling variant, shared by the tests below."""
    return Generator(ckpt[0])


@pytest.fixture(scope="module")
def greedy32(ckpt, gen32):
    """32 greedy steps over two_prompts through gen32, with their logits (the tests that compare them)."""
    return gen32.generate(two_prompts(ckpt[2]), 32, return_logits=True)


@pytest.mark.slow
def test_cached_logits_equal_the_full_forward_at_every_step(ckpt, greedy32):
    """32 greedy steps over two prompts of different lengths. Reference: the training path's forward over each
    row's own unpadded sequence (positions from 0), whose causal logits at position n+s-1 are those of a full
    forward of the first n+s tokens; and the uncached static-shape baseline, a full forward every step."""
    model, _, tok = ckpt
    prompts = two_prompts(tok)
    assert len(prompts[0]) != len(prompts[1])
    cached = greedy32
    uncached = model.generate(prompts, 32, return_logits=True, use_cache=False)
    assert cached.logits.shape == (32, 2, 4096)
    # 2e-5: kernels/layers.cc's vectorized exp (SwiGLU) and its scalar tail round the same input apart by an ulp,
    # and which one an element takes depends on the row length (the cache's, or the uncached forward's)
    np.testing.assert_allclose(uncached.logits, cached.logits, atol=2e-5)
    ms.set_context(mode=ms.PYNATIVE_MODE)  # two eager forwards of different lengths: no graphs to compile
    try:
        for row, prompt in enumerate(prompts):
            assert cached.samples[row].tokens == uncached.samples[row].tokens
            seq = list(prompt) + cached.samples[row].tokens[:31]
            full = model(Tensor(np.array([seq], np.int32))).asnumpy()[0, len(prompt) - 1:]
            # the training forward runs the fused kernel (model.attention_kernel=auto): another summation order
            np.testing.assert_allclose(cached.logits[:, row], full, atol=2e-5)
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


@pytest.mark.slow
def test_the_plain_cached_path_gives_the_kernels_logits_and_a_reused_cache_carries_nothing_over(ckpt, gen32,
                                                                                                greedy32):
    """Off CPU fp32 (Ascend, fp16) the caches are written by MindSpore's Assign and read back in the same graph;
    here the same weights without the kernels give the fused decode op's logits at every step. Prompts of one
    shape run through the caches the call before left: the same logits as on the fresh (zero) caches of the
    generator's first call (the plain path reads every column, hidden or not) and, for the fused op, as the plain
    path's."""
    built_kernel("attention")  # (else plain against plain: skipped with the reason, or failed where it should be)
    model, _, tok = ckpt
    cfg = OmegaConf.merge(load_preset("model", "tiny"), {"init_std": 0.1, "attention_kernel": "plain",
                                                         "layer_kernels": "plain"})
    plain = build_model(cfg, 64, "fp32", "CPU", seed=3)
    assert not libraries_in(plain) & {"attention", "layers"} and "attention" in libraries_in(model)
    first, second = two_prompts(tok), [tok.encode(LINES[2][:20]), tok.encode(LINES[3])]
    fresh = plain.generate(second, 32, return_logits=True).logits  # the first call: zero caches
    np.testing.assert_allclose(plain.generate(first, 32, return_logits=True).logits, greedy32.logits, atol=2e-5)
    caches = len(gen32.cached), len(plain._generator.cached)
    again = plain.generate(second, 32, return_logits=True).logits  # through the caches `first` left
    np.testing.assert_array_equal(again, fresh)
    np.testing.assert_allclose(gen32.generate(second, 32, return_logits=True).logits, again, atol=2e-5)
    assert (len(gen32.cached), len(plain._generator.cached)) == caches  # one set of caches for the shape


@pytest.mark.usefixtures("pynative")  # a few eager steps: no graphs to compile for this variant
def test_cache_with_tied_head_linear_rope_scaling_and_mha():
    variant = {"tie_embeddings": True, "rope_scaling": {"type": "linear", "factor": 2.0}, "num_kv_heads": 4}
    model = build_model(OmegaConf.merge(load_preset("model", "tiny"), {"init_std": 0.1}, variant), 64, "fp32", "CPU",
                        seed=1)
    prompts = [[5, 9, 300, 41, 7, 12, 90], [77, 3000, 8]]
    cached = model.generate(prompts, 4, return_logits=True)
    for row, prompt in enumerate(prompts):
        seq = list(prompt) + cached.samples[row].tokens[:3]
        full = model(Tensor(np.array([seq], np.int32))).asnumpy()[0, len(prompt) - 1:]
        np.testing.assert_allclose(cached.logits[:, row], full, atol=1e-5)


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_generate(ckpt, tmp_path, capsys):
    import torch
    from transformers import LlamaForCausalLM

    model, path, tok = ckpt
    prompts = [tok.encode(line) for line in LINES]
    ours = model.generate(prompts, 64, eos_id=None)
    export_hf(path, str(tmp_path / "hf"))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # no eos on either side: all 64 tokens
    width = max(map(len, prompts))
    ids, mask = torch.zeros((4, width), dtype=torch.long), torch.zeros((4, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as ours
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with one_torch_thread(), torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=64, pad_token_id=0)
    assert theirs.shape == (4, width + 64)
    for i in range(4):
        assert ours.samples[i].tokens == theirs[i, width:].tolist()
        assert len(set(ours.samples[i].tokens)) > 16  # not a degenerate repetition
    # the CLI on the Hugging Face directory (imported through models.convert.import_hf) continues the same way
    assert cli.main([str(tmp_path / "hf"), "--prompt", LINES[1], "--max-new-tokens", "10", "--temperature", "0",
                     "--ignore-eos"]) == 0
    # (less a character its 10th token leaves unfinished: never shown broken)
    assert capsys.readouterr().out == tok.decode(tok.whole_chars(prompts[1] + ours.samples[1].tokens[:10])) + "\n"


@pytest.mark.slow
def test_two_graphs_for_a_32_token_generation_whatever_the_option_values(ckpt, gen32):
    before = gen32.compile_count  # (the greedy pair, where the tests above ran)
    result = gen32.generate(two_prompts(ckpt[2]), 32, SamplingOptions(temperature=0.8, seed=0))
    assert result.timings["steps"] == 32 and all(len(s.tokens) == 32 for s in result.samples)
    assert gen32.compile_count == before + 2  # prefill [2, 16] and decode [2, 1], sampling in both: none per token
    gen32.generate([ckpt[2].encode(LINES[2]), ckpt[2].encode(LINES[3])], 32,
                   SamplingOptions(temperature=0.8, seed=1))  # the same shapes: no new graph
    assert gen32.compile_count == before + 2
    # another temperature is an input of the same two graphs, not a pair of its own
    other = gen32.generate(two_prompts(ckpt[2]), 32, SamplingOptions(temperature=0.5, seed=0))
    assert gen32.compile_count == before + 2 and other.timings["compile_s"] == 0
    assert [s.tokens for s in other.samples] != [s.tokens for s in result.samples]
    # top-k / top-p: one more pair (the graphs that sort the vocabulary), whatever their values
    filtered = [[s.tokens for s in gen32.generate(two_prompts(ckpt[2]), 32, SamplingOptions(**options)).samples]
                for options in ({"temperature": 0.5, "top_k": 20, "top_p": 0.9, "seed": 0},
                                {"temperature": 1.2, "top_k": 5, "seed": 0})]
    assert gen32.compile_count == before + 4 and filtered[0] != filtered[1]


@pytest.mark.slow
def test_sampling_options(ckpt, gen32):
    tok = ckpt[2]
    prompts = two_prompts(tok)

    def tokens(**options):
        return [s.tokens for s in gen32.generate(prompts, 32, SamplingOptions(**options)).samples]

    greedy = tokens()
    first, again = tokens(temperature=1.0, seed=1), tokens(temperature=1.0, seed=1)
    assert first == again and first != tokens(temperature=1.0, seed=2) and first != greedy
    assert tokens(temperature=1.0, top_k=1, seed=5) == greedy
    assert tokens(temperature=1.0, top_p=1e-6, seed=5) == greedy
    assert tokens(temperature=0.7, top_p=0.9, top_k=40, seed=3) == tokens(temperature=0.7, top_p=0.9, top_k=40, seed=3)
    repeats = [len(row) - len(set(row)) for row in greedy]
    assert sum(len(row) - len(set(row)) for row in tokens(repetition_penalty=5.0)) < sum(repeats)
    # a row's sample depends on its seed and row index, not on the rows beside it
    assert first[1] == [s.tokens for s in gen32.generate(
        [prompts[1], prompts[1]], 32, SamplingOptions(temperature=1.0, seed=1)).samples][1]
    # stop strings (cut before) and eos
    text = tok.decode(prompts[0] + greedy[0])[len(LINES[0]):]
    stop = text[6:9]
    (stopped, _) = gen32.generate(prompts, 32, stop=[stop], decode=tok.decode).samples
    assert stopped.finish_reason == "stop" and stopped.text == text[:text.find(stop)]
    eos = greedy[0][3]
    ended = gen32.generate(prompts, 32, eos_id=eos).samples[0]
    assert ended.finish_reason == "eos" and ended.tokens == greedy[0][:greedy[0].index(eos)]
    # the option sets above ran in four pairs of graphs: greedy, greedy with the penalty, sampling, with top-k / top-p
    assert {key[3:] for key in gen32.cells} == {(False, False, False), (False, False, True), (True, False, False),
                                                (True, True, False)} and gen32.compile_count == 8


@pytest.mark.slow
def test_generate_fn_batches_without_changing_the_text(ckpt, gen32):
    """make_generate_fn runs prompts batch_size at a time (the last batch filled up): the texts, greedy or
    sampled (each prompt on its own random stream), equal one batch of all of them (batches of 2: gen32's
    greedy and sampling graphs)."""
    from models.generation import make_generate_fn

    tok = ckpt[2]
    prompts = LINES + [LINES[0][:9]]
    for sampling in (SamplingOptions(), SamplingOptions(temperature=1.0, seed=4)):
        whole = make_generate_fn(gen32, tok, batch_size=5)(prompts, 32, sampling=sampling)
        assert make_generate_fn(gen32, tok, batch_size=2)(prompts, 32, sampling=sampling) == whole
        assert len(set(whole)) > 1


def test_the_sampler_follows_hugging_faces_processors(pynative):
    """Sampler's penalty, temperature, top-k and top-p against transformers' logits processors (the same tokens
    left, the same values), and its draw against the inverse CDF of those logits in float64."""
    import torch
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 50)) * 3).astype(np.float32)
    seen = rng.random((3, 50)) < 0.2
    seen[:, 0] = True
    input_ids = torch.tensor(np.stack([np.resize(np.flatnonzero(row), 50) for row in seen]))  # each row's seen ids
    filtering = Sampler(sampled=True, filtering=True)  # the option values are inputs: one cell for several
    for sampler, (temperature, top_k, top_p, penalty) in [
            (Sampler(penalized=True), (0.0, 0, 1.0, 2.0)), (filtering, (0.7, 5, 1.0, 1.0)),
            (filtering, (1.0, 0, 0.8, 1.0)), (filtering, (1.0, 50, 1.0, 1.0)),
            (Sampler(sampled=True, filtering=True, penalized=True), (0.7, 10, 0.9, 1.3)),
            (Sampler(sampled=True, penalized=True), (0.8, 0, 1.0, 1.3))]:
        options = Tensor(np.array([temperature, top_k, top_p, penalty], np.float32))
        ours = sampler.filtered(Tensor(logits), Tensor(seen), options).asnumpy()
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, torch.tensor(logits))
        if temperature:
            theirs = TemperatureLogitsWarper(temperature)(input_ids, theirs)
            theirs = TopKLogitsWarper(top_k)(input_ids, theirs) if top_k else theirs
            theirs = TopPLogitsWarper(top_p)(input_ids, theirs) if top_p < 1 else theirs
        theirs = theirs.numpy()
        assert (np.isinf(ours) == np.isinf(theirs)).all() and np.isinf(ours).any() == (0 < top_k < 50 or top_p < 1)
        np.testing.assert_allclose(ours[np.isfinite(ours)], theirs[np.isfinite(theirs)], rtol=1e-6)
        u = 1.0 - rng.random(3)
        chosen = sampler(Tensor(logits), Tensor(seen), Tensor(u.astype(np.float32)), options).asnumpy()
        if not temperature:
            assert chosen.tolist() == ours.argmax(-1).tolist()
            continue
        cdf = np.cumsum(np.exp(ours.astype(np.float64) - ours.max(-1, keepdims=True)), -1)
        assert chosen.tolist() == (cdf < u[:, None] * cdf[:, -1:]).sum(-1).tolist()


@pytest.mark.slow
def test_cli_writes_samples_and_streams(ckpt, tmp_path, capsys):
    _, path, tok = ckpt
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": line, "id": i}) + "\n" for i, line in enumerate(LINES[:3])))
    out = tmp_path / "samples.jsonl"
    assert cli.main([path, "--prompts-file", str(prompts), "--out", str(out), "--batch-size", "2",
                     "--max-new-tokens", "24", "--temperature", "0", "--ignore-eos"]) == 0
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["id"] for s in samples] == [0, 1, 2] and [s["prompt"] for s in samples] == LINES[:3]
    assert all(s["new_tokens"] == 24 and s["finish_reason"] == "length" and s["completion"] for s in samples)
    capsys.readouterr()
    single = tmp_path / "single.jsonl"
    assert cli.main([path, "--prompt", LINES[0], "--max-new-tokens", "24", "--temperature", "0.8",
                     "--top-p", "0.95", "--seed", "7", "--out", str(single)]) == 0
    printed, log = capsys.readouterr()
    (sample,) = [json.loads(line) for line in single.read_text().splitlines()]
    assert printed == LINES[0] + sample["completion"] + "\n"  # streamed: the prompt, then the completion
    assert sample["completion"] != samples[0]["completion"] and "2 graphs compiled" in log


def bad_inputs(path, tmp_path):
    hf = tmp_path / "gpt2"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    return {
        "empty prompt": ([path, "--prompt", ""], "--prompt: the prompt is empty"),
        "prompt longer than the context": ([path, "--prompt", "To be, or not to be. " * 300],
                                           "longer than the model's context (max_position_embeddings=1024)"),
        "cache overflow": ([path, "--prompt", LINES[0], "--max-new-tokens", "1020"], "--max-new-tokens: 1020"),
        "top_p 0": ([path, "--prompt", "x", "--top-p", "0"], "--top-p: must be in (0, 1]"),
        "top_p above 1": ([path, "--prompt", "x", "--top-p", "1.5"], "--top-p: must be in (0, 1], got 1.5"),
        "negative temperature": ([path, "--prompt", "x", "--temperature", "-0.5"], "--temperature: must be >= 0"),
        "unsupported HF architecture": ([str(hf), "--prompt", "x"], "architectures ['GPT2LMHeadModel'] are not "
                                                                    "supported"),
        "missing checkpoint": ([str(tmp_path / "nowhere"), "--prompt", "x"], "no such directory"),
    }


def test_cli_bad_inputs_give_one_error_line_and_exit_2(ckpt, tmp_path, capsys):
    for name, (argv, expected) in bad_inputs(ckpt[1], tmp_path).items():
        assert cli.main(argv) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and expected in err, (name, err)


def test_cli_as_a_process_exits_2_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "generate", str(tmp_path / "nowhere"), "--prompt", "x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: CKPT_OR_HF_DIR: no such directory: {tmp_path / 'nowhere'}\n"


@pytest.mark.slow
@pytest.mark.parametrize("template", ["alpaca", "chatml"])
def test_an_instruction_is_prompted_as_the_checkpoints_training_template_renders_it(ckpt, tmp_path, template):
    """`--instruction` and prompts-file instructions / chats are wrapped in the checkpoint's data.template: the
    prompt is the text (and the ids) SFT trained the model to answer after; the HF export's chat template renders
    the same text for transformers' apply_chat_template."""
    import shutil

    from transformers import AutoTokenizer

    from data.samples import encode_parts, prompt_parts, render, template_of

    _, path, tok = ckpt
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    saved = OmegaConf.load(copy / "config.yaml")
    saved.data = {"template": {"name": template}}
    OmegaConf.save(saved, copy / "config.yaml")
    t = template_of(saved)
    expected = render({"instruction": "Name a colour.", "input": "", "output": ""}, t)[0][0]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"instruction": "Name a colour."}) + "\n" + json.dumps({"messages": chat}) + "\n")
    out = tmp_path / "samples.jsonl"
    # one new token: the prompts are what is checked, and the decode graph is never compiled
    assert cli.main([str(copy), "--prompts-file", str(prompts), "--out", str(out), "--max-new-tokens", "1",
                     "--temperature", "0"]) == 0
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["instruction"] == "Name a colour." and first["prompt"] == expected
    assert second["prompt"] == "".join(text for text, _ in prompt_parts({"messages": chat}, t))
    assert encode_parts(tok, prompt_parts({"instruction": "Name a colour."}, t))[0] == tok.encode(expected)

    hf_dir = tmp_path / "hf"
    assert cli_convert([str(copy), str(hf_dir), "--to", "hf"]) == 0
    hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert hf_tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False,
                                      add_generation_prompt=True) == expected
    assert hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == second["prompt"]
    assert json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
