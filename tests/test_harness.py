"""harness.py: lm-evaluation-harness's model interface over a mindlab checkpoint."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

import harness as H


def test_rolling_windows_are_lm_evals_docstring_example():
    """lm_eval's LM.loglikelihood_rolling docstring: tokens 0..9 (here 1..10), prefix BOS (here 0), context 4:
    BOS 0 1 2 -> 0 1 2 3; 3 4 5 6 -> 4 5 6 7; 5 6 7 8 -> 8 9 (each token predicted once, the last window with
    a full context)."""
    rows = H.rolling_windows(list(range(1, 11)), 0, 4)
    assert rows == [([0, 1, 2, 3, 4], 4), ([4, 5, 6, 7, 8], 4), ([6, 7, 8, 9, 10], 2)]
    assert H.rolling_windows([7], 0, 4) == [([0, 7], 1)] and H.rolling_windows([], 0, 4) == []


@pytest.fixture(scope="module")
def lm(base_checkpoint):
    """In the checkpoint's runtime (trainer.mode: graph), which MindlabLM sets up as `python -m harness` does."""
    return H.MindlabLM(base_checkpoint, batch_size=2, max_length=64)


def eager_log_probs(model, ids):
    """log softmax of the model's logits over `ids` [1, S]: a reference forward, eagerly (no graph compiled)."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        return ms.ops.log_softmax(model(Tensor(np.array(ids, np.int32))), -1).asnumpy()[0]
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def request(*args):
    return SimpleNamespace(args=args)


@pytest.mark.slow
def test_rolling_loglikelihood_scores_every_token_once(lm):
    text = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 3
    ids = [lm.tokenizer.eos_id] + lm.tokenizer.encode(text)
    logp = eager_log_probs(lm.model, [ids[:-1]])
    direct = float(sum(logp[j, t] for j, t in enumerate(ids[1:])))  # one window: the whole text as context
    (whole,) = H.MindlabLM(lm.checkpoint, batch_size=2, max_length=256).loglikelihood_rolling([request(text)])
    assert whole == pytest.approx(direct, abs=1e-3)
    (windowed,) = lm.loglikelihood_rolling([request(text)])  # 64-token windows: less context, other score
    assert len(ids) - 1 > 64 and math.isfinite(windowed) and windowed != pytest.approx(whole, abs=1e-3)


@pytest.mark.slow
def test_loglikelihood_is_greedy_marks_the_models_own_choice(lm):
    context = lm.tokenizer.encode("To be, or not to be")
    ids = np.array([[lm.tokenizer.eos_id] + context], np.int32)
    ranked = np.argsort(-eager_log_probs(lm.model, ids)[-1])
    best, other = int(ranked[0]), int(ranked[1])
    (logp_best, greedy_best), (logp_other, greedy_other) = lm.scorer.score(
        [(list(ids[0]) + [best], 1), (list(ids[0]) + [other], 1)])
    assert greedy_best and not greedy_other and logp_best > logp_other
    pairs = [("To be, or not to", " be"), ("ROMEO:\n", "But soft")]
    scored = lm.loglikelihood([request(*p) for p in pairs])
    assert [s for s, _ in scored] == pytest.approx(lm.scorer(pairs), abs=1e-6)  # python -m evaluation's scorer


@pytest.mark.slow
def test_generate_until_cuts_at_the_stop_string(lm):
    (free,) = lm.generate_until([request("To be, or", {"max_gen_toks": 12})])
    assert free
    stop = free.strip()[:2]
    (cut,) = lm.generate_until([request("To be, or", {"max_gen_toks": 12, "until": [stop]})])
    assert stop not in cut and free.startswith(cut)


@pytest.mark.slow
def test_lm_eval_scores_a_mindlab_task_as_evaluate_does(base_checkpoint, tmp_path, lm):
    """lm-evaluation-harness (requirements.txt pins it) through `python -m harness`'s run() on a mindlab task file:
    exactly the acc and acc_norm of python -m evaluation's scorer on the same checkpoint and items."""
    from evaluation.tasks import load_task, score_multiple_choice

    path = tmp_path / "mini_mc.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in [
        {"context": "To be, or not to", "choices": [" be", " sing", " the question"], "gold": 0},
        {"context": "ROMEO:\n", "choices": ["But soft", "What light", "Arise"], "gold": 1},
        {"context": "Now is the winter of our", "choices": [" discontent", " table"], "gold": 0}]))
    results = H.run(base_checkpoint, [str(path)], None, None, 2, 64)["mindlab_mini_mc"]
    ours = score_multiple_choice(load_task(path).items, lm.scorer)
    assert results["acc,none"] == pytest.approx(ours["acc"]) and results["acc_norm,none"] == pytest.approx(
        ours["acc_norm"])
