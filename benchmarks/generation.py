"""Generation speed on one set of random weights: mindlab with its KV cache (built as `python -m generate` builds
it: on CPU in fp32 each decoding step's attention is one kernels/attention.cc op a layer, and at batch 1 its
products are kernels/layers.cc's one-row op), the same with MindSpore's ops only ("plain ops"), mindlab without a
cache (a full forward of the whole padded sequence every step), and transformers' `generate` (its own cache), side
by side.

    scripts/venv.sh python -m benchmarks.generation [--model small] [--batch 1] [--prompt-len 32] [--new 128 512]

Greedy, eos off, so every run makes exactly `new` tokens per row. Decode tokens/s counts the tokens after the
first (the first comes from the prompt's forward, timed as prefill) over the time of those steps, compilation
excluded; mindlab's compile time (the prefill + decode graphs, or the one uncached graph, per cache length) is
its own column. transformers' prefill and decode are timed inside one generate(new) call, after a warm-up
call: from its start to the first token chosen, and from there to the last. Each run
is a fresh process; torch runs with 1 thread and with one per CPU (on a loaded machine OpenMP's 2 threads can
be much slower than 1). "KV cache, one core" is the cached run with every thread of its process on one CPU
(`taskset -c 0 python -m generate ...` does the same): MindSpore's threads pass every graph launch between them,
and when other processes keep the CPUs busy every hand-off across two CPUs waits for the scheduler. `--busy N`
runs N busy-looping processes beside every measurement, to see that. Also printed: whether each run's tokens
equal the cached run's.
"""
import boot  # noqa: F401  (first: imports MindSpore before anything that loads protobuf)

import argparse
import multiprocessing
import os
import tempfile
import time

import numpy as np
from omegaconf import OmegaConf
from benchmarks.results import recorded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_config(name: str):
    from models.llama.config import LlamaConfig

    raw = OmegaConf.load(os.path.join(ROOT, "conf", "model", f"{name}.yaml"))
    return OmegaConf.merge(OmegaConf.structured(LlamaConfig), {k: v for k, v in raw.items() if k != "defaults"})


def ours(ckpt: str, prompts, new: int, use_cache: bool, kernels: str = "auto") -> dict:
    """The model as `python -m generate` builds it; kernels=plain: model.attention_kernel and layer_kernels plain
    (MindSpore's ops only, as on a machine without the built kernels)."""
    from models.common.generation import Generator
    from models.pretrained import build, graph_mode

    cfg = OmegaConf.load(os.path.join(ckpt, "config.yaml")).model
    graph_mode("CPU")
    model = build(OmegaConf.merge(cfg, {"attention_kernel": kernels, "layer_kernels": kernels}), ckpt, "CPU")
    gen = Generator(model)
    result = gen.generate(prompts, new, eos_id=None, use_cache=use_cache)
    t = result.timings
    return {"compile_s": t["compile_s"], "graphs": gen.compile_count, "prefill_s": t["prefill_s"],
            "decode_tps": len(prompts) * (new - 1) / t["decode_s"], "tokens": [s.tokens for s in result.samples]}


def transformers_generate(hf_dir: str, prompts, new: int, threads: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        """The time each token is chosen (generate asks its stopping criteria after every token), never stopping."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    torch.set_num_threads(threads)  # explicit: the parent's MindSpore runtime set OMP_NUM_THREADS=1 in our environment
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding needed
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    clock = Clock()
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, **kwargs)  # warm-up
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new, stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
    assert len(clock.times) == new, clock.times
    # one call: the prefill ends when the first token is chosen, the decode steps are the tokens after it
    return {"compile_s": None, "graphs": None, "prefill_s": clock.times[0] - start,
            "decode_tps": len(prompts) * (new - 1) / (clock.times[-1] - clock.times[0]),
            "tokens": out[:, ids.shape[1]:].tolist()}


def one_core() -> None:
    """Every thread of this process (MindSpore's, started when it was imported, included) on its first CPU."""
    cpu = {min(os.sched_getaffinity(0))}
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpu)


def busy_loop() -> None:
    while True:
        pass


def measure(impl: str, ckpt: str, hf_dir: str, prompts, new: int) -> dict:
    """One run in its own process (spawned): no thread pool or allocator of the other framework around."""
    if impl == "cached-1core":
        one_core()
    if impl.startswith("transformers"):
        return transformers_generate(hf_dir, prompts, new, int(impl.split("-")[1]))
    kernels = "plain" if impl == "cached-plain" else "auto"
    return ours(ckpt, prompts, new, use_cache=impl != "uncached", kernels=kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="a conf/model preset (random weights)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes to run beside every measurement")
    args = parser.parse_args()

    import mindspore as ms

    from base import checkpoint
    from models.convert import export_hf
    from models.llama.model import LlamaForCausalLM

    cfg = model_config(args.model)
    model = LlamaForCausalLM(cfg, "fp32", seed=0)  # numpy init: no graph runs in this process
    prompts = np.random.default_rng(0).integers(4, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    names = {"cached": "mindlab, KV cache", "cached-plain": "mindlab, KV cache, plain ops",
             "cached-1core": "mindlab, KV cache, one core",
             "uncached": "mindlab, no cache",
             **{f"transformers-{n}": f"transformers generate, {n} torch thread{'s' * (n > 1)}"
                for n in sorted({1, os.cpu_count()})}}
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        ckpt = checkpoint.save(os.path.join(workdir, "ckpt"), 0, model, ms.nn.SGD(model.trainable_params()), {},
                               OmegaConf.create({"model": cfg}))
        hf_dir = os.path.join(workdir, "hf")
        export_hf(ckpt, hf_dir)
        print(f"model={args.model} ({sum(p.size for p in model.trainable_params()) / 1e6:.1f}M parameters, "
              f"{cfg.num_layers} layers, hidden {cfg.hidden_size}), batch {args.batch}, prompt {args.prompt_len} "
              f"tokens, greedy, {os.cpu_count()} CPUs, {args.busy} busy-looping processes beside; each run in its own "
              f"process", flush=True)
        spawn = multiprocessing.get_context("spawn")
        busy = [spawn.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
        for p in busy:
            p.start()
        with spawn.Pool(1, maxtasksperchild=1) as pool:
            for new in args.new:
                runs = {}
                for impl in names:
                    runs[impl] = pool.apply(measure, (impl, ckpt, hf_dir, prompts, new))
                    print(f"  {new} new tokens: {names[impl]} done", flush=True)
                for impl, r in runs.items():
                    rows.append((new, names[impl], r, r["tokens"] == runs["cached"]["tokens"]))
        for p in busy:
            p.terminate()
    print(f"\n| new tokens | implementation | graphs | compile s | prefill s | decode tokens/s | ms/step | "
          f"tokens = cached |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for new, name, r, same in rows:
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.2f}"
        graphs = "-" if r["graphs"] is None else str(r["graphs"])
        print(f"| {new} | {name} | {graphs} | {compile_s} | {r['prefill_s']:.3f} | {r['decode_tps']:.1f} | "
              f"{1000 * args.batch / r['decode_tps']:.2f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    with recorded("benchmarks.generation", "Generation speed: KV cache, against transformers' generate"):
        main()
