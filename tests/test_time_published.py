"""The dry run's time model (planner/timing.py) against published training throughput, out of sample: 32 runs on
three kinds of hardware (A100, H100, Atlas 800T A2), each predicted within 30% of the tokens/s per device its
authors report by the compute_efficiency fitted to the other 31 (leave-one-out).

The runs, their sources and how each maps onto the planner are in planner/published.py:
  [N]  Narayanan et al. 2021 (Megatron-LM) Table 1: ten GPT models from 1.7B on 32 A100s to 1T on 3,072.
  [MF] MindFormers' model library: Llama 2 7B / 13B / 70B at 4K on Atlas 800T A2.
  [MT] MindSpore Transformers' performance tuning guide: Llama 2 13B on Atlas 800T A2, dp8, dp8 pp2, with full and
       selective recompute.
  [L3] The Llama 3 paper, Table 4: Llama 3 405B on 8,192 and 16,384 H100s, at 8K and at 128K with cp 16.
  [TT] torchtitan: Llama 3 8B / 70B and Llama 2 13B / 70B with FSDP (ZeRO-3) on 64 A100s.
  [LF] LLM Foundry: MPT 7B / 13B / 30B at 2K-8K with FSDP (ZeRO-3) on one node of 8 H100s.
  [MC] Megatron-Core's MoE README: Mixtral 8x7B on 64 H100s (TP 1, EP 8, PP 4, VP 8): the moe family's expert
       parallelism, its memory and all-to-all terms.
  [MZ] NVIDIA's Megatron MoE Model Zoo: Mixtral 8x22B on 128 H100s (TP 2, PP 8, EP 8, VP 7).
  [MX] MindFormers' Mixtral model card: Mixtral 8x7B fine-tuned on 16 Atlas 900 A2 NPUs (DP 8, EP 8, PP 2).
What the predictions rest on besides the fit (docs/planning.md has the model): the presets' peaks, links (rails:
a group crossing nodes rides the NICs of its ranks on a node) and memory bandwidth (Megatron's 2021 attention had
no flash kernel: its [a, s, s] scores go through HBM, a quarter of the step at 1.7B); the mapping's assumptions
(planner/published.py): micro-batch sizes where a source gives none, Llama 3's interleave depth (vp 2).
Memory: none of these sources gives a per-device memory figure for its configuration; the memory model's published
checks are tests/test_memory_published.py.
"""
import pytest

from planner.published import RUNS, device, fit, leave_one_out

TOLERANCE = 0.30


@pytest.fixture(scope="module")
def out_of_sample():
    return {run.name: (efficiency, ratio) for run, efficiency, ratio in leave_one_out(RUNS)}


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_each_run_predicted_out_of_sample_within_30_percent(run, out_of_sample):
    efficiency, ratio = out_of_sample[run.name]
    print(f"{run.name}: efficiency fitted to the others {efficiency:.3f}, predicted / published = {ratio:.2f}")
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE


def test_the_table_spans_the_hardware_and_the_layout_options():
    """At least 20 runs; A100, at least 6 on H100 and 6 on Atlas 800T A2; context parallelism, interleaving,
    ZeRO-3 and three mixture-of-experts runs with expert parallelism among them."""
    assert len(RUNS) >= 20
    assert {r.device for r in RUNS} == {"a100", "h100", "ascend910b"}
    assert sum(r.device == "ascend910b" for r in RUNS) >= 6 and sum(r.device == "h100" for r in RUNS) >= 6
    assert any(r.cp > 1 for r in RUNS) and any(r.vp > 1 for r in RUNS) and sum(r.zero3 for r in RUNS) >= 3
    assert sum(r.family == "moe" and r.ep > 1 for r in RUNS) >= 3


def test_the_presets_carry_the_fit_to_every_run(out_of_sample):
    """The device presets' compute_efficiency is the fit to all the runs; the leave-one-out fits stay within 0.02
    of it (no run pulls the fit far)."""
    fitted = fit(RUNS)
    for name in ("a100", "h100", "ascend910b"):
        assert device(name).compute_efficiency == pytest.approx(fitted, abs=0.005)
    assert max(abs(efficiency - fitted) for efficiency, _ in out_of_sample.values()) < 0.02
