"""Training at long sequence lengths on CPU, tokens/s and peak RSS per length, for each attention path:
  plain    MindSpore ops on [B, heads, S, S] (model.attention_kernel=plain, models/llama/model.py CoreAttention)
  chunked  the same in blocks of --chunk query rows with selective recompute (model.attention_chunk)
  fused    kernels/attention.cc (model.attention_kernel=fused): blocks of 64 rows, only lse kept

    python -m benchmarks.attention_memory                       # model=small, lengths 512..4096
    python -m benchmarks.attention_memory --model tiny --lengths 1024 2048 4096 8192 --plain-up-to 2048
    python -m benchmarks.attention_memory --modes fused,plain --lengths 2048

Each run is train.py in a subprocess (its own peak RSS): micro-batch 1, graph mode, a few steps of the
default data; plain attention is run only up to --plain-up-to (its [heads, S, S] scores per layer grow 4x per
doubling; 4096 would take ~10 GB of the shared box).
"""
import argparse
import tempfile

from benchmarks.measure import train_and_measure
from benchmarks.results import recorded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--plain-up-to", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", default="plain,chunked,fused", help="comma-separated, of plain, chunked, fused")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for length in args.lengths:
            for mode in args.modes.split(","):
                if mode == "plain" and length > args.plain_up_to:
                    continue
                extra = {"plain": ["model.attention_kernel=plain"], "fused": ["model.attention_kernel=fused"],
                         "chunked": ["model.attention_kernel=plain", f"model.attention_chunk={args.chunk}",
                                     "model.recompute=selective"]}[mode]
                overrides = [f"model={args.model}", f"model.max_position_embeddings={max(length, 1024)}",
                             f"data.seq_len={length}", "trainer.micro_batch_size=1", "trainer.global_batch_size=1",
                             f"trainer.max_steps={args.steps}", "trainer.log_every=2", "trainer.eval_every=0",
                             "trainer.save_every=0", "optim.warmup_steps=1", *extra]
                m = train_and_measure(f"{mode}-{length}", overrides, work)
                rows.append((length, mode, m["tokens_per_sec"], m["peak_rss_gb"]))
                print(f"{length:>6} {mode:>8} {m['tokens_per_sec']:>9.0f} tok/s  peak RSS {m['peak_rss_gb']:.2f} GB",
                      flush=True)
    print(f"\nmodel={args.model}, micro-batch 1, chunk {args.chunk} + recompute=selective for 'chunked'\n")
    print("| seq_len | attention | tokens/s | peak RSS (GB) |\n|---:|---|---:|---:|")
    for length, mode, tps, rss in rows:
        print(f"| {length} | {mode} | {tps:.0f} | {rss:.2f} |")


if __name__ == "__main__":
    with recorded("benchmarks.attention_memory", "Training at long sequence lengths: tokens/s and peak RSS per attention path"):
        main()
