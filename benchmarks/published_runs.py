"""Published training runs against the dry run's time model, out of sample: each run's tokens/s per device predicted
with the compute_efficiency fitted to the other runs (leave-one-out), against what its authors report (the runs,
their sources and the mapping: planner/published.py). Writes its section of benchmarks/RESULTS.md.

    scripts/venv.sh python -m benchmarks.published_runs
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

from benchmarks.results import recorded


def layout(r) -> str:
    """A run's layout in a few words."""
    cp = f" cp{r.cp}" if r.cp > 1 else ""
    vp = f" vp{r.vp}" if r.vp > 1 else ""
    ep = f" ep{r.ep}" if r.ep > 1 else ""
    shard = " zero3" if r.zero3 else " zero1" if r.optimizer_shard else ""
    return f"dp{r.dp} tp{r.tp}{cp} pp{r.pp}{vp}{ep}{shard}, {r.micro_batches} x mbs {r.micro_batch_size}, {r.recompute}"


def main() -> None:
    import plugins

    plugins.register()  # before planner.published, whose Llama 3 rows count FLOPs through the llama family
    from planner.published import OUTLIERS, RUNS, fit, leave_one_out, own, predict, ratio as ratio_at

    fitted = fit(RUNS)
    folds = leave_one_out(RUNS)
    errors = [ratio - 1 for _, _, ratio in folds]
    print(f"{len(RUNS)} runs ({', '.join(f'{sum(r.device == d for r in RUNS)} {d}' for d in ('a100', 'h100', 'ascend910b'))}); "
          f"compute_efficiency fitted to all of them: {fitted:.3f} (the presets carry it); each run's own: "
          f"{min(map(own, RUNS)):.2f}-{max(map(own, RUNS)):.2f}")
    print(f"out of sample (each run predicted by the fit to the other {len(RUNS) - 1}): ratios "
          f"{min(errors) + 1:.2f}-{max(errors) + 1:.2f}, mean absolute error {sum(map(abs, errors)) / len(errors):.1%}, "
          f"worst {max(map(abs, errors)):.1%}\n")
    print("| run | source | device | layout | published tokens/s/device | predicted out of sample | ratio | fit to the others | MFU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r, efficiency, ratio in folds:
        t = predict(r, efficiency)
        print(f"| {r.name} | {r.source} | {r.device} | {layout(r)} | {r.published:,.0f} | "
              f"{t.tokens_per_s_per_device:,.0f} | {ratio:.2f} | {efficiency:.3f} | {t.mfu:.0%} |")
    print(f"\nOutliers (planner/published.py says why), predicted by the fit to the {len(RUNS)} runs above:\n")
    print("| run | source | device | layout | published tokens/s/device | predicted | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in OUTLIERS:
        print(f"| {r.name} | {r.source} | {r.device} | {layout(r)} | {r.published:,.0f} | "
              f"{predict(r, fitted).tokens_per_s_per_device:,.0f} | {ratio_at(r, fitted):.2f} |")


if __name__ == "__main__":
    with recorded("benchmarks.published_runs", "The time model against published training runs, out of sample"):
        main()
