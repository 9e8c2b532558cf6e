"""Published training runs against the dry run's time model: predicted vs published tokens/s per device, and the fit
of device.compute_efficiency (the runs, their sources and the mapping: planner/published.py).

    scripts/venv.sh python -m benchmarks.published_runs
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

from planner.published import RUNS, fit, predict
from benchmarks.results import recorded


def main() -> None:
    import plugins

    plugins.register()
    megatron_runs = [r for r in RUNS if r.source == "N"]
    fitted, own = fit(megatron_runs)
    print(f"compute_efficiency fitted to [N]'s {len(megatron_runs)} rows: {fitted:.3f} "
          f"(each row's own: {min(own):.2f}-{max(own):.2f}); the device presets use 0.56\n")
    print("| run | source | device | layout | predicted tokens/s/device | published | ratio | MFU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in RUNS:
        t = predict(r)
        print(f"| {r.name} | {r.source} | {r.device} | dp{r.dp} tp{r.tp} pp{r.pp}, {r.micro_batches} x mbs "
              f"{r.micro_batch_size}, recompute {r.recompute} | {t.tokens_per_s_per_device:,.0f} | {r.published:,.0f} | "
              f"{t.tokens_per_s_per_device / r.published:.2f} | {t.mfu:.0%} |")


if __name__ == "__main__":
    with recorded("benchmarks.published_runs", "The time model against published training runs"):
        main()
