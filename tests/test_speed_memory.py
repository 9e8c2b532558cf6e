"""benchmarks/speed_memory.py's figures from a run's per-step log, by hand."""
from benchmarks.speed_memory import round_ratios, summarize, table


def run(tokens_per_sec, losses=None):
    losses = losses or [7.0] * len(tokens_per_sec)
    logs = [{"tokens_per_sec": t, "peak_rss_gb": 1.5, "loss": loss} for t, loss in zip(tokens_per_sec, losses)]
    return {"logs": logs, "first_log_s": 8.0, "wall_s": 30.0, "load": [1.0, 1.0]}


def test_a_one_off_slow_step_moves_the_mean_not_the_median_step():
    # the first step (compile) is left out; then three steps at 1,000 tokens/s and one at 250 (4x as long)
    r = summarize(run([100, 1000, 1000, 250, 1000]), warmup=1, flops_per_token=1e6, peak_flops=1e10)
    assert abs(r["tokens_per_sec"] - 4 / (3 / 1000 + 1 / 250)) < 1e-9  # 571.4: total tokens / total time
    assert abs(r["median_step_tokens_per_sec"] - 1000) < 1e-9  # the median of (1, 1, 4, 1) ms per token is 1
    assert abs(r["mfu"] - r["tokens_per_sec"] * 1e6 / 1e10) < 1e-12


def test_round_ratios_gives_both_estimates_per_round_and_their_median():
    # round 2: MindFormers' third step takes twice as long, its mean 3 / (2 / 1000 + 1 / 500) = 750 tokens/s
    rounds = [{"native": summarize(run([1, n, n, n]), 1, 1.0, 1.0),
               "mindformers": summarize(run([1, m, m, slow]), 1, 1.0, 1.0)}
              for n, m, slow in ((1300, 1000, 1000), (1400, 1000, 500), (1200, 1000, 1000))]
    lines = round_ratios("small", rounds).splitlines()
    assert lines == ["small: native / mindformers tokens/s by round 1.30, 1.87, 1.20; median x1.30",
                     "small: native / mindformers median step by round 1.30, 1.40, 1.20; median x1.30"]


def test_the_loss_curve_gap_is_the_largest_relative_difference_at_any_step():
    native = summarize(run([1, 1000, 1000, 1000], [8.0, 7.0, 6.0, 5.0]), 1, 1.0, 1.0)
    torch = summarize(run([1, 900, 900, 900], [8.0, 7.0 + 7e-6, 6.0, 5.0 - 1e-6]), 1, 1.0, 1.0)
    lines = table({"native": native, "torch_sdpa": torch}).splitlines()
    assert lines[-1] == ("native / torch_sdpa: loss curve within 1.0e-06 (relative) over 4 steps, "
                         "the largest gap at step 2")
    mindformers = summarize(run([1, 800, 800, 800], [9.0, 8.0, 7.0, 6.0]), 1, 1.0, 1.0)  # its own initial weights
    assert "loss curve" not in table({"native": native, "mindformers": mindformers})
