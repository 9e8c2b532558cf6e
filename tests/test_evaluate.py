"""evaluation/ and `python -m evaluation`: bits per byte, per-token NLL, loss by position, task formats and scoring,
the task builders (builders/tasks.py) on the real tiny corpora, the CLI on a small checkpoint, and an objective
defined here getting bits per byte and task scores through its hook alone."""
import glob
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import MISSING, OmegaConf

import mindspore as ms
from mindspore import Tensor

import evaluation.__main__ as E
from base.errors import ConfigError
from base.objective import ObjectiveBase, ObjectivePlugin
from base.paths import task_path
from builders import corpus_parsers as P
from builders import instruction_set as S
from builders import tasks as BT
from conftest import CORPORA, corpus_path, load_preset
from helpers import shakespeare_data
from data.tokenizer import Tokenizer
from evaluation import bpb as B
from evaluation import tasks as T
from evaluation.config import split_arguments
from evaluation.passkey import PASSKEY_NEEDLE, passkey_accuracy, passkey_rows
from evaluation.position import loss_by_position
from evaluation.scorer import LoglikelihoodScorer, encode_pair, token_nll
from evaluation.sources import fill_mask_counts
from objectives.clm import TokenNLL

TINY = sorted(glob.glob(os.path.join(CORPORA, "tiny", "*.jsonl")))


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    return Tokenizer(tokenizer_file)


def tiny_llama(seed=3, **overrides):
    from models import build_model

    return build_model(OmegaConf.merge(load_preset("model", "tiny"), overrides), 64, "fp32", "CPU", seed)


# ------------------------------------------------------------------------------------------ bits per byte

def test_piece_bytes_and_bits_per_byte_by_hand(tok):
    sp = tok.sp
    the, newline, eos = sp.piece_to_id("\u2581the"), sp.piece_to_id("<0x0A>"), tok.eos_id
    word = next(i for i in range(tok.vocab_size) if sp.id_to_piece(i) == "\u2581and")
    assert sp.id_to_piece(the) == "\u2581the" and sp.is_byte(newline)
    table = B.piece_bytes(tok)
    assert (table[the], table[newline], table[eos], table[tok.pad_id], table[word]) == (4, 1, 0, 0, 4)
    # a row: [the] -> targets: \n, the, eos, and(starts the next document: its dummy-prefix '▁' is not text)
    row = np.array([[the, newline, the, eos, word]])
    nll = np.array([[1.0, 2.0, 0.5, 3.0]])
    n_bytes = B.target_bytes(row, table, eos, B.dummy_prefix_pieces(tok))
    assert n_bytes.tolist() == [[1, 4, 0, 3]]
    assert B.bits_per_byte(nll.sum(), n_bytes.sum()) == pytest.approx(6.5 / math.log(2) / 8)
    assert B.target_bytes(row, table).tolist() == [[1, 4, 0, 4]]  # without the dummy-prefix rule


@pytest.mark.parametrize("dummy_prefix", [True, False])
def test_the_dummy_prefix_is_told_as_the_tokenizers_model_states_it(tmp_path, dummy_prefix):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    path = tmp_path / "sp.model"
    with open(path, "wb") as out:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(["the cat sat on the mat and the dog"] * 50),
                                       model_writer=out, vocab_size=300, hard_vocab_limit=False, byte_fallback=True,
                                       add_dummy_prefix=dummy_prefix, minloglevel=2)
    sp_tok = Tokenizer(str(path))
    stated = model_pb2.ModelProto.FromString(sp_tok.sp.serialized_model_proto()).normalizer_spec.add_dummy_prefix
    assert stated == dummy_prefix
    pieces = B.dummy_prefix_pieces(sp_tok)
    assert (pieces is not None) == dummy_prefix
    if dummy_prefix:
        sp = sp_tok.sp  # a text's first piece carries the prefix; a byte piece never does
        assert pieces[sp.encode("the cat")[0]] and not pieces[sp.piece_to_id("<0x41>")]


def test_target_bytes_count_exactly_the_text_of_packed_documents(tok):
    texts = ["To be, or not to be: that is the question.\n", "  Whether 'tis nobler\tin the mind — to suffer", "x"]
    tokens = [t for text in texts for t in tok.encode(text) + [tok.eos_id]]
    row = np.array([tokens])
    n_bytes = B.target_bytes(row, B.piece_bytes(tok), tok.eos_id, B.dummy_prefix_pieces(tok))
    first = tok.decode(tokens[:1])  # the first token is context only, never a target
    assert n_bytes.sum() == sum(len(t.encode("utf-8")) for t in texts) - len(first.encode("utf-8"))


def test_unigram_nll_is_add_one_smoothed():
    nll = B.unigram_nll(np.array([1, 1, 2]), np.array([1, 3]), vocab_size=4)
    np.testing.assert_allclose(nll, [-math.log(3 / 7), -math.log(1 / 7)])


def test_loss_by_position_on_a_constructed_array():
    nll = np.arange(10, dtype=float).reshape(2, 5)  # [[0..4], [5..9]]
    buckets = loss_by_position(nll, 2)
    assert [(b["start"], b["end"], b["tokens"]) for b in buckets] == [(0, 2, 4), (2, 4, 4), (4, 5, 2)]
    assert [b["loss"] for b in buckets] == [(0 + 1 + 5 + 6) / 4, (2 + 3 + 7 + 8) / 4, (4 + 9) / 2]
    masked = loss_by_position(nll, 3, mask=np.array([[1, 0, 1, 1, 1], [0, 0, 0, 1, 0]]))
    assert masked[0]["loss"] == 1.0 and masked[0]["tokens"] == 2
    assert masked[1] == {"start": 3, "end": 5, "tokens": 3, "loss": (3 + 4 + 8) / 3}
    assert math.isnan(loss_by_position(nll, 5, mask=np.zeros((2, 5)))[0]["loss"])


def test_token_nll_cell_mean_equals_the_training_loss_cell(pynative):
    from objectives.clm import CausalLMLoss

    model = tiny_llama()
    ids = np.random.default_rng(0).integers(4, 4096, (3, 33)).astype(np.int32)
    nll = token_nll(TokenNLL(model), [ids[:2], ids[2:]])
    assert nll.shape == (3, 32)
    loss = float(CausalLMLoss(model)(Tensor(ids), Tensor(ids))[0].asnumpy())
    assert nll.mean() == pytest.approx(loss, abs=1e-5)
    logp = ms.ops.log_softmax(model(Tensor(ids[:, :-1])), -1).asnumpy()
    np.testing.assert_allclose(nll[1, 7], -logp[1, 7, ids[1, 8]], atol=1e-5)


# ------------------------------------------------------------------------------------------------- scoring

def test_acc_and_acc_norm_with_a_stub_scorer():
    items = [{"context": "Q1", "choices": [" a", " bbbbbbbb"], "gold": 1},   # acc wrong, acc_norm right
             {"context": "Q2", "choices": [" yes", " no", " maybe"], "gold": 0},  # both right
             {"context": "Q3", "choices": [" x", " y"], "gold": 0}]  # both wrong
    table = {("Q1", " a"): -2.0, ("Q1", " bbbbbbbb"): -4.0, ("Q2", " yes"): -1.0, ("Q2", " no"): -3.0,
             ("Q2", " maybe"): -9.0, ("Q3", " x"): -5.0, ("Q3", " y"): -1.0}
    calls = []
    result = T.score_multiple_choice(items, lambda requests: calls.append(requests) or [table[r] for r in requests])
    assert len(calls) == 1 and len(calls[0]) == 7  # one batched call
    assert result["acc"] == pytest.approx(1 / 3) and result["acc_norm"] == pytest.approx(2 / 3)
    assert result["chance"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 2) / 3) and result["n"] == 3
    assert [p["pred"] for p in result["predictions"]] == [0, 0, 1]


def test_rouge_l_and_exact_match_by_hand():
    # LCS(the cat sat on the mat, the cat lay on the mat) = "the cat on the mat" = 5; P = R = 5/6
    assert T.rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # LCS(a b c d, b d e) = "b d" = 2; P = 2/4, R = 2/3, F = 2PR/(P+R) = 4/7
    assert T.rouge_l("a b c d", "b d e") == pytest.approx(4 / 7)
    # LCS(x y z, z y) = 1 (order matters); P = 1/3, R = 1/2, F = 2/5
    assert T.rouge_l("x y z", "z y") == pytest.approx(2 / 5)
    assert T.rouge_l("", "a") == 0.0 and T.rouge_l("a b", "c") == 0.0 and T.rouge_l("same  words", "same words") == 1
    assert T.lcs_length("ABCBDAB", "BDCABA") == 4  # the textbook example (CLRS)
    items = [{"prompt": "p1", "answer": "in the beginning", "until": ["\n"]}, {"prompt": "p2", "answer": "a b c d"}]
    outputs = {"p1": " in the beginning\nGod created", "p2": "b d e"}
    result = T.score_generation(items, lambda prompts, n: [outputs[p] for p in prompts], 16)
    assert result["exact_match"] == 0.5 and result["rouge_l"] == pytest.approx((1 + 4 / 7) / 2)
    assert result["predictions"] == ["in the beginning", "b d e"]


def hand_accuracies(items, predictions) -> tuple:
    """lm-evaluation-harness's acc and acc_norm from each item's choice log-likelihoods: the gold choice is the
    argmax of the log-likelihoods, and of them divided by each choice's length in bytes."""
    acc = np.mean([np.argmax(p["loglikelihoods"]) == it["gold"] for it, p in zip(items, predictions)])
    norm = np.mean([np.argmax(np.array(p["loglikelihoods"]) / [len(c.encode()) for c in it["choices"]]) == it["gold"]
                    for it, p in zip(items, predictions)])
    return float(acc), float(norm)


def hand_rouge_l(prediction: str, answer: str) -> float:
    """ROUGE-L F1 over whitespace tokens, its LCS by brute force: the longest subsequence of the (short) answer that
    is also a subsequence of the prediction."""
    import itertools

    def within(sub, words):
        it = iter(words)
        return all(w in it for w in sub)  # each word found after the previous one

    a, b = prediction.split(), answer.split()
    lcs = max((k for k in range(len(b) + 1) for sub in itertools.combinations(b, k) if within(sub, a)), default=0)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


@pytest.mark.slow
def test_scorer_on_a_real_tiny_model_end_to_end(tok, pynative):
    model = tiny_llama()
    cell = TokenNLL(model)
    scorer = LoglikelihoodScorer(cell, tok, batch_size=3, max_len=64)
    items = [{"context": "To be, or not to", "choices": [" be", " sing", " the question"], "gold": 0},
             {"context": "ROMEO:\n", "choices": ["But soft", "What light", "Arise"], "gold": 1},
             {"context": "x " * 100, "choices": [" y", " z"], "gold": 0}]  # context cut on the left
    result = T.score_multiple_choice(items, scorer)
    assert result["n"] == 3 and (result["acc"], result["acc_norm"]) == hand_accuracies(items, result["predictions"])
    batched = [ll for p in result["predictions"] for ll in p["loglikelihoods"]]
    requests = [(it["context"], c) for it in items for c in it["choices"]]
    alone = [0, 2, 3, 7]  # scored alone: batching, neighbours and padding change nothing
    one_by_one = LoglikelihoodScorer(cell, tok, batch_size=1, max_len=64)([requests[i] for i in alone])
    np.testing.assert_allclose([batched[i] for i in alone], one_by_one, atol=1e-4)
    ctx, cont = encode_pair(tok, "To be, or not to", " be")  # by hand: eos, context, continuation
    ids = np.array([[tok.eos_id] + ctx + cont], np.int32)
    logp = ms.ops.log_softmax(model(Tensor(ids[:, :-1])), -1).asnumpy()[0]
    direct = sum(logp[len(ctx) + k, t] for k, t in enumerate(cont))
    assert one_by_one[0] == pytest.approx(direct, abs=1e-4)


def test_encode_pair_moves_trailing_whitespace_to_the_continuation(tok):
    ctx, cont = encode_pair(tok, "Word: ", "apple")
    assert tok.decode(ctx) == "Word:" and ctx + cont == tok.encode("Word: apple")


@pytest.mark.slow
def test_generation_tasks_use_greedy_cached_generation(tokenizer_file):
    """The tasks' generate_fn is the family generator's (models/generation.py make_generate_fn): greedy
    continuations equal the generator's own. In graph mode: both run the generator's one pair of graphs, compiled
    once (eager decoding steps cost more than the compile)."""
    from models import build_model
    from models.generation import generator
    from objectives.clm import Config, Objective

    model = build_model(load_preset("model", "tiny"), 64, "fp32", "CPU", seed=0)
    tok = Tokenizer(tokenizer_file)
    _, fn, _ = T.scorers(Objective(Config(name="clm")), model, "llama", tok, 2, 64)
    texts = fn(["To be, or not", "O Romeo"], 6)
    expected = generator("llama", model).generate([tok.encode("To be, or not"), tok.encode("O Romeo")], 6,
                                                  eos_id=tok.eos_id, decode=tok.decode)
    assert texts == [s.text for s in expected.samples] and all(texts)


def test_fill_mask_top1_equals_the_mlm_accuracy_of_the_loss_cell(pynative):
    from models import build_model
    from objectives.mlm import FillMaskTopK, MaskedLMLoss, mask_tokens

    assert fill_mask_counts(np.array([[[5, 6], [7, 8], [1, 2]]]), np.array([[6, 7, -100]])) == (2, 1, 2)
    model = build_model(OmegaConf.merge(load_preset("model", "bert_tiny"), {"vocab_size": 512}), 32, "fp32",
                        "CPU", seed=1)
    ids = np.random.default_rng(0).integers(10, 512, (2, 32)).astype(np.int32)
    masked, labels = mask_tokens(ids, np.random.default_rng(1), 0.3, 4, 512, [0, 1, 2, 3])
    inputs = (masked, np.zeros_like(ids), np.ones_like(ids), labels)
    topk, returned = (x.asnumpy() for x in FillMaskTopK(model, 5, [0, 1, 2, 3])(*map(Tensor, inputs)))
    n, top1, top5 = fill_mask_counts(topk, returned)
    _, _, accuracy = MaskedLMLoss(model, False)(*map(Tensor, inputs))
    assert (returned == labels).all() and n == int((labels != -100).sum()) > 0 and top1 <= top5
    assert top1 / n == pytest.approx(float(accuracy.asnumpy()), abs=1e-6)


# -------------------------------------------------------------------------------------------- task files

@pytest.mark.parametrize("lines, message", [
    (['{"context": "c", "choices": [" a", " b"], "gold": 0}', '{"context": "c", "choices": [" a", " b"], "gold": 2}'],
     ":2: gold 2 is out of range for 2 choices"),
    (['{"context": "c", "gold": 0}'], ":1: multiple-choice item: 'choices' is missing"),
    (['{"context": "c", "choices": [" a", " b"]}'], ":1: multiple-choice item: 'gold' is missing"),
    (['{"context": "c", "choices": [" a", " b"], "gold": true}'], ":1: 'gold' must be an integer"),
    (['{"context": "c", "choices": " a", "gold": 0}'], ":1: 'choices' must be a list of at least 2"),
    (['', '{"context": "c", "choices": [" a", " b"], "gold": 0', ], ":2: not JSON"),
    (['{"prompt": "p"}'], ":1: generation item: 'answer' is missing"),
    (['{"question": "q"}'], ":1: the item has neither 'context'"),
    (['{"prompt": "p", "answer": "a"}', '{"context": "c", "choices": [" a", " b"], "gold": 0}'],
     ":2: a multiple-choice item in a file of generation items"),
])
def test_bad_task_files_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(T.TaskError) as err:
        T.load_task(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def test_task_names_map_to_files(tmp_path):
    assert task_path("verse_mc", tmp_path) == tmp_path / "verse_mc.jsonl"
    assert task_path("/x/mine.jsonl", tmp_path) == Path("/x/mine.jsonl")
    with pytest.raises(T.TaskError, match="no such task file"):
        T.load_tasks(["missing"], str(tmp_path), 0)


@pytest.fixture(scope="module")
def built():
    corpus_path("tiny")
    docs = list(S.read_documents(TINY))
    return BT.build(docs, n_items=500, seed=0), {d["id"]: d for d in docs}


def test_builders_on_the_tiny_corpora_give_true_golds_and_different_distractors(built, tmp_path):
    tasks, by_id = built
    assert all(tasks[name] for name in BT.BUILDERS), {k: len(v) for k, v in tasks.items()}
    for name, items in tasks.items():
        for item in items:
            if "choices" in item:
                texts = {" ".join(c.split()).casefold() for c in item["choices"]}
                assert len(item["choices"]) == 4 and len(texts) == 4, item
    for item in tasks["definitions_mc"]:
        assert item["choices"][item["gold"]] == " " + item["entry"]
        gloss = item["context"].removeprefix("Definition: ").removesuffix("\nWord:")
        assert P.normalize(gloss) in P.normalize(by_id[item["id"]]["text"])
        assert S.split_of("dict", item["entry"], BT.VAL_FRACTION) == "val"
    for item in tasks["cloze_code"]:
        lines = by_id[item["id"]]["text"].split("\n")
        t = item["line"] - 1
        assert item["choices"][item["gold"]] == lines[t] and item["context"] == "\n".join(lines[t - 5:t]) + "\n"
        indent = {c[:len(c) - len(c.lstrip())] for c in item["choices"]}
        assert len(indent) == 1  # distractors re-indented like the true line
        assert S.split_of("python", item["entry"], BT.VAL_FRACTION) == "val"
    for item in tasks["verse_mc"]:
        verses = dict(P.bible_verses(by_id[item["id"]]["text"]))
        number, first = item["context"].split(" ", 1)
        assert item["entry"].endswith(":" + number)
        assert first + item["choices"][item["gold"]] == verses[item["entry"]]
        assert S.split_of("bible", item["entry"], BT.VAL_FRACTION) == "val"
    for item in tasks["verse_complete"]:
        verses = dict(P.bible_verses(by_id[item["id"]]["text"]))
        assert item["prompt"].split(" ", 1)[1] + " " + item["answer"] == verses[item["entry"]]
    BT.write_tasks(tmp_path, tasks, {})
    kinds = {name: T.load_task(tmp_path / f"{name}.jsonl").kind for name in tasks}
    assert kinds == {"definitions_mc": "multiple_choice", "cloze_code": "multiple_choice",
                     "verse_mc": "multiple_choice", "verse_complete": "generation"}
    again = BT.build(S.read_documents(TINY), n_items=500, seed=0)
    assert again == tasks  # a function of the files and the seed


def test_task_val_fraction_is_the_instruction_sets_default():
    import inspect

    assert inspect.signature(S.build).parameters["val_fraction"].default == BT.VAL_FRACTION


# -------------------------------------------------------------------------------------------------- the CLI

def test_eval_keys_are_checked():
    eval_cfg, tasks, rest = split_arguments(["tasks=[a,b]", "eval.batches=3", "data.seq_len=128",
                                             "eval.context_lengths=[128,512]"])
    assert (eval_cfg.batches, eval_cfg.context_lengths, tasks, rest) == (3, [128, 512], ["a", "b"], ["data.seq_len=128"])
    with pytest.raises(ConfigError, match="eval.bachtes: unknown key; did you mean eval.batches"):
        split_arguments(["eval.bachtes=3"])
    with pytest.raises(ConfigError, match="eval.batches"):
        split_arguments(["eval.batches=many"])


def test_help_lists_the_eval_keys_with_their_comments(capsys):
    with pytest.raises(SystemExit) as done:
        E.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "eval.position_bucket=128" in out and "target positions per bucket of loss by position" in out
    assert "eval.passkey_lengths=[]" in out and "prompt lengths (tokens)" in out


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory, tokenizer_file):
    """A tiny Llama checkpoint whose data is the tokenizer fixture's own (Shakespeare, its cache reused)."""
    from base import checkpoint

    model = tiny_llama(seed=5)
    data = shakespeare_data(tokenizer_file)
    cfg = OmegaConf.create({"model": OmegaConf.to_container(load_preset("model", "tiny")),
                            "data": OmegaConf.to_container(data), "objective": {"name": "clm", "ignore_index": -100},
                            "trainer": {"micro_batch_size": 2, "eval_batches": 1, "seed": 0}})
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    return checkpoint.save(str(root), 7, model, ms.nn.SGD(model.trainable_params()), {}, cfg, tokenizer_file)


@pytest.mark.slow
def test_cli_on_a_small_checkpoint_prints_the_table_and_writes_json(small_checkpoint, tmp_path, capsys):
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / "mini_mc.jsonl").write_text(
        json.dumps({"context": "To be, or not to", "choices": [" be", " sing"], "gold": 0}) + "\n" +
        json.dumps({"context": "O Romeo, Romeo, wherefore art", "choices": [" thou", " the"], "gold": 0}) + "\n")
    (tasks_dir / "mini_gen.jsonl").write_text(json.dumps({"prompt": "To be, or", "answer": "not to be"}) + "\n")
    out = tmp_path / "results.json"
    code = E.main([small_checkpoint, "tasks=[mini_mc,mini_gen]", "eval.position_bucket=64",
                   "eval.context_lengths=[128]", "--tasks-dir", str(tasks_dir), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "bits/byte" in printed and "unigram bpb" in printed and "mini_mc" in printed and "0-64" in printed
    results = json.loads(out.read_text())
    source = results["data_eval"]["sources"]["shakespeare"]
    assert source["tokens"] == 2 * 256 and source["loss"] == pytest.approx(source["token_nll_mean"], abs=1e-4)
    assert source["bits_per_byte"] == pytest.approx(source["token_nll_mean"] * source["tokens"] / math.log(2)
                                                    / source["bytes"], rel=1e-6)
    assert source["loss"] > 7 and source["unigram_loss"] < source["loss"]  # random weights: worse than unigram
    assert [b["end"] for b in source["by_position"]] == [64, 128, 192, 256]
    assert set(results["data_eval"]["context_lengths"]) == {"128", "256"}
    mc = results["tasks"]["mini_mc"]
    mc_items = [json.loads(line) for line in (tasks_dir / "mini_mc.jsonl").read_text().splitlines()]
    assert mc["n"] == 2 and mc["chance"] == 0.5
    assert (mc["acc"], mc["acc_norm"]) == hand_accuracies(mc_items, mc["predictions"])
    gen = results["tasks"]["mini_gen"]
    said = gen["predictions"][0]  # the greedy answer, scored by hand against "not to be"
    assert gen["exact_match"] == float(said.strip() == "not to be")
    assert gen["rouge_l"] == pytest.approx(hand_rouge_l(said, "not to be"))
    assert results["step"] == 7 and results["data"] == "default"


def test_cli_refuses_model_presets_and_bad_task_files(small_checkpoint, tmp_path, capsys):
    assert E.main([small_checkpoint, "model=small", "tasks=[]"]) == 2
    assert "config error: model: comes from the checkpoint" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"context": "c", "choices": [" a"], "gold": 0}\n')
    assert E.main([small_checkpoint, "tasks=[bad]", "--tasks-dir", str(tmp_path)]) == 2
    assert f"{tmp_path / 'bad.jsonl'}:1: 'choices' must be a list of at least 2" in capsys.readouterr().err


@dataclass
class SecondHalfConfig:
    name: str = MISSING  # second_half


class SecondHalf(ObjectiveBase):
    """An objective evaluation has never heard of: causal LM loss on the second half of each packed row only.
    What it exposes for evaluation is its `token_nll` hook."""

    inputs = ("input_ids", "labels")
    metrics = ()

    def __init__(self, cfg, tokenizer=None, seed: int = 0):
        pass

    def batch(self, rows: dict, sample: int) -> tuple:
        ids = rows["input_ids"]
        labels = ids.copy()
        labels[:, :1 + ids.shape[1] // 2] = -100  # targets labels[:, 1:]: the second half of the row
        return ids, labels

    def loss_tokens(self, inputs: tuple) -> int:
        return int((inputs[1][:, 1:] >= 0).sum())

    def loss_cell(self, model):
        from objectives.clm import CausalLMLoss

        return CausalLMLoss(model)

    def token_nll(self, model):
        return TokenNLL(model)


@pytest.fixture
def second_half(monkeypatch):
    """`objective=second_half`, registered as a plug-in registers itself (base/registry.py OBJECTIVES)."""
    from base.registry import OBJECTIVES
    from data.packing import PACKED
    from plugins import register

    module = SimpleNamespace(__name__="tests.second_half", Config=SecondHalfConfig, check=lambda cfg: None,
                             row_spec=lambda cfg: PACKED, Objective=SecondHalf)
    monkeypatch.setitem(OBJECTIVES._items, "second_half", ObjectivePlugin("second_half", module))
    register()  # its preset, objective=second_half


@pytest.mark.slow
@pytest.mark.parametrize("objective, targets", [("clm", 256), ("second_half", 128)])
def test_training_logs_the_bits_per_byte_and_task_scores_that_evaluate_gives(tokenizer_file, tmp_path, pynative,
                                                                             second_half, objective, targets):
    """trainer.eval_tasks and val_bpb: what the run logs at its last step equals `python -m evaluation` on the
    checkpoint it leaves (per-token NLLs, bytes and task scorers computed independently of the loss cell), for
    clm and for an objective defined in this file, which gets them through its `token_nll` hook alone."""
    from conftest import compose_cfg
    from trainer.loop import train

    task = tmp_path / "mini_mc.jsonl"
    task.write_text("".join(json.dumps({"context": c, "choices": x, "gold": 0}) + "\n" for c, x in [
        ("To be, or not to", [" be", " sing", " the"]), ("O Romeo, Romeo, wherefore art", [" thou", " the"]),
        ("Now is the winter of our", [" discontent", " table"])]))
    cfg = compose_cfg("model=tiny", "trainer.max_steps=2", "trainer.micro_batch_size=2", "trainer.eval_batches=1",
                      "trainer.eval_every=1", "trainer.log_every=1", "logger.progress_bar=false",
                      "optim.warmup_steps=1", "optim.lr=1e-2", f"trainer.eval_tasks=[{task}]", "trainer.mode=pynative",
                      f"objective={objective}")
    cfg.data = shakespeare_data(tokenizer_file)
    run_dir = tmp_path / "run"
    last = train(cfg, str(run_dir))
    evals = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "val_bpb" in line]
    assert [m["step"] for m in evals] == [0, 1, 2] and evals[2]["val_bpb"] < evals[0]["val_bpb"]  # lr 1e-2 learns
    out = tmp_path / "eval.json"
    assert E.main([str(run_dir / "checkpoints" / "step_000002"), f"tasks=[{task}]", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    source = results["data_eval"]["sources"]["shakespeare"]
    assert results["data_eval"]["objective"] == objective and source["tokens"] == 2 * targets
    assert last["val_loss"] == pytest.approx(source["loss"], rel=1e-6)
    assert last["val_bpb/shakespeare"] == pytest.approx(source["bits_per_byte"], rel=1e-5)
    assert last["val_bpb"] == pytest.approx(results["data_eval"]["all"]["bits_per_byte"], rel=1e-5)
    assert last["val_task/mini_mc/acc"] == results["tasks"]["mini_mc"]["acc"]
    assert last["val_task/mini_mc/acc_norm"] == results["tasks"]["mini_mc"]["acc_norm"]


def test_target_bytes_with_labels_count_only_the_labelled_targets(tok):
    row = np.array([[tok.eos_id] + tok.encode("To be") + tok.encode(" or not")], np.int32)
    labels = row.copy()
    n_prompt = 1 + len(tok.encode("To be"))
    labels[0, :n_prompt] = -100  # SFT: the prompt carries no loss
    table = B.piece_bytes(tok)
    full = B.target_bytes(row, table, tok.eos_id, B.dummy_prefix_pieces(tok))
    masked = B.target_bytes(row, table, tok.eos_id, B.dummy_prefix_pieces(tok), labels)
    by_hand = sum(len(tok.sp.id_to_piece(int(i)).replace("\u2581", " ").encode()) for i in row[0, n_prompt:])
    assert masked.sum() == full[:, n_prompt - 1:].sum() == by_hand
    assert (masked[:, :n_prompt - 1] == 0).all()


def test_alpaca_samples_are_generation_items_with_the_sft_prompt(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps({"instruction": "Define the word \"cat\".", "input": "Dictionary: WordNet 3.0",
                                "output": "n 1: a small feline", "task": "define_word"}) + "\n")
    task = T.load_task(path)
    assert task.kind == "generation" and task.items[0]["answer"] == "n 1: a small feline"
    assert task.items[0]["prompt"].endswith("### Input:\nDictionary: WordNet 3.0\n\n### Response:\n")
    from data.samples import TEMPLATES  # prompted as the checkpoint was tuned: the article's template

    assert T.load_task(path, template=TEMPLATES["alpaca_zh"]).items[0]["prompt"] == \
        "### 指令: Define the word \"cat\".\n### 输入: Dictionary: WordNet 3.0\n### 输出: "


def test_passkey_rows_hide_the_key_at_the_depth_and_score_by_likelihood(tok):
    """Rows are exactly length + 1 tokens: eos, filler with the needle at the depth, question, candidate key;
    a scorer that knows the key (NLL 0 on its tokens only) gets accuracy 1, one that prefers a wrong key 0."""
    keys = [12345, 67890, 24680]
    rows, counts = passkey_rows(tok, 256, 0.25, keys[0], keys)
    assert rows.shape == (3, 257) and rows[0, 0] == tok.eos_id
    needle = tok.encode(PASSKEY_NEEDLE.format(key=keys[0]))
    at = next(i for i in range(257) if list(rows[0, i:i + len(needle)]) == needle)
    assert abs(at / 257 - 0.25) < 0.05
    for row, key, n in zip(rows, keys, counts):
        assert list(row[-n:]) == tok.encode(f" {key}")

    class Oracle:  # NLL 0 where the row ends with the hidden key's tokens, 1 elsewhere
        def __init__(self, good):
            self.good = good

        def __call__(self, ids):  # (NLL, is-greedy), as TokenNLL returns them
            ids = ids.asnumpy()
            nll = np.array([[0.0 if self.good(r) else 1.0] * (ids.shape[1] - 1) for r in ids], np.float32)
            return Tensor(nll), Tensor(nll == 0)

    def needle_key(r):
        return tok.decode(r.tolist()).split("The pass key is ")[1][:5] == tok.decode(r.tolist())[-5:]
    assert passkey_accuracy(Oracle(needle_key), tok, [128], [0.5], 4)["128"]["0.5"] == 1.0
    assert passkey_accuracy(Oracle(lambda r: not needle_key(r)), tok, [128], [0.5], 4)["128"]["0.5"] == 0.0
    # scored 2 rows at a time (3 rounds down to a divisor of 10): the same rows, in the same order
    assert passkey_accuracy(Oracle(needle_key), tok, [128], [0.5], 4, batch_size=3)["128"]["0.5"] == 1.0


def test_an_sft_checkpoint_is_evaluated_on_the_documents_of_the_run_it_descends_from(tmp_path, base_checkpoint):
    """No data= given: a checkpoint that trained on instruction samples (or pairs) is scored as a language model
    on the documents of the checkpoint it started from (stage.init_from), back to its pretraining; given as a run
    directory or its `latest`, as every checkpoint argument."""
    import shutil

    from omegaconf import OmegaConf

    from base import checkpoint
    from evaluation.config import compose_config

    run = tmp_path / "sft_run"
    step = run / "checkpoints" / "step_000010"
    shutil.copytree(base_checkpoint, step)
    (run / "checkpoints" / "latest").write_text("step_000010\n")
    saved = OmegaConf.load(step / "config.yaml")
    saved.data = OmegaConf.merge(saved.data, {"name": "instructions", "sources": [
        {"name": "instructions", "kind": "alpaca", "paths": ["/nowhere/train.jsonl"]}]})
    saved.stage.init_from = base_checkpoint
    OmegaConf.save(saved, step / "config.yaml")
    cfg = compose_config(checkpoint.resolve(str(run)), [])
    base = OmegaConf.load(os.path.join(base_checkpoint, "config.yaml"))
    assert cfg.data.name == base.data.name and [s.name for s in cfg.data.sources] == [s.name for s in base.data.sources]
    assert cfg.objective.name == "clm"
    (tmp_path / "a.txt").write_text("some text\n")
    typed = compose_config(str(step), [f"data.sources=[{{name: mine, kind: text, paths: [{tmp_path / 'a.txt'}]}}]"])
    assert typed.data.name == "command-line sources mine"  # what the report labels them, not the preset's name
    saved.stage.init_from = str(tmp_path / "gone")
    OmegaConf.save(saved, step / "config.yaml")
    with pytest.raises(ConfigError, match="is not there to say which documents it knows; give them, e.g. data="):
        compose_config(str(step), [])


def test_bits_per_byte_leaves_out_a_source_whose_targets_hold_no_bytes():
    """A held-out batch whose only loss target is an eos (an SFT response cut off by truncation) has a loss and no
    bits per byte; the other sources' val_bpb is theirs alone, by hand: nats / ln 2 / bytes."""
    from evaluation.validation import val_metrics

    per_source = {"a": ({"loss": 2.0}, 10), "eos_only": ({"loss": 5.0}, 2)}
    out = val_metrics(per_source, (), {"a": 40, "eos_only": 0})
    assert out["val_loss"] == pytest.approx((2.0 * 10 + 5.0 * 2) / 12)
    assert out["val_bpb"] == out["val_bpb/a"] == pytest.approx(2.0 * 10 / math.log(2) / 40)
    assert "val_bpb/eos_only" not in out
    assert "val_bpb" not in val_metrics({"eos_only": ({"loss": 5.0}, 2)}, (), {"eos_only": 0})
