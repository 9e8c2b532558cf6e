"""The first thing to run on a new Ascend or GPU machine: does mindlab compile, run and learn here, and how fast?

    make device-check                                   # python -m benchmarks.device_check
    python -m benchmarks.device_check --device h100 --precision fp16 --steps 100

Each check is the command a user would type, run as its own process on this machine's accelerator (the device
preset: ascend910b on Ascend, h100 on GPU, or --device), next to the same command on CPU in fp32:

    pretrain     stage=tiny_pretrain for --steps steps in the device's compute dtype (bf16; flash attention on Ascend)
    sft+lora     stage=sft peft=lora from that checkpoint, a few steps on instruction samples written here
    generate     greedy tokens of the device's pretrained checkpoint on the device (python -m generate's model,
                 the KV cache graphs), against the same checkpoint's greedy tokens on CPU in fp32
    dp2xtp2xpp2  with 8 devices or more: model=tiny laid out dp2 x tp2 x pp2 (train.py starts msrun), against one
                 CPU process at the same global batch, both from the CPU pretraining's weights (a sharded build
                 initialises its weights at random on the device: only a common start makes the losses comparable);
                 the device's loss is its last pipeline stage's, the one that computes it

and prints, per check, tokens/s, MFU against the device preset's peak at the compute dtype, peak device memory
(MindSpore's memory pool) and the loss beside the CPU fp32 run's on the same batches (for generation: how many
leading greedy tokens agree). It exits 0 when every check ran, every loss is within --tolerance of CPU's and at
least --min-agreement of the greedy tokens agree, else 1; on a machine without an accelerator it says so in one
line and exits 1. The runs stay in --workdir (a temporary directory by default) for their logs and metrics.jsonl.
"""
import boot  # noqa: F401  (first: imports MindSpore before anything that loads protobuf)

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from base.errors import entry_point
from base.schema import as_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {"Ascend": "ascend910b", "GPU": "h100"}  # the device preset a check uses by default on each target
LAYOUT = {"dp": 2, "tp": 2, "pp": 2, "micro_batches": 2}
MICRO_BATCH = 16  # stage=tiny_pretrain's
TOLERANCE = 0.05  # relative loss difference to CPU fp32: bf16's 8-bit mantissa moves a short run's loss by ~1%
# leading greedy tokens that must equal CPU fp32's on the same checkpoint: bf16 logits may break a near-tie, after
# which a prompt's tokens differ (all are counted lost), but a broken cache or sampler agrees on next to none
MIN_AGREEMENT = 0.5


@dataclass
class Result:
    """One check: what the device measured and the CPU fp32 reference (None: not measured)."""
    name: str
    steps: int = 0
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_gb: Optional[float] = None
    loss: Optional[float] = None
    cpu_loss: Optional[float] = None
    agree: Optional[str] = None  # generation: how many greedy tokens equal CPU fp32's, e.g. "29 of 32"
    agreed: Optional[float] = None  # that as a fraction
    error: Optional[str] = None  # the check did not run: the last line it printed


def accelerator() -> Optional[str]:
    """The accelerator target MindSpore finds here (Ascend before GPU), or None."""
    from base.validate import devices_here

    return next((target for target in ("Ascend", "GPU") if devices_here(target) > 0), None)


def difference(result: Result) -> Optional[float]:
    """|device loss - CPU loss| / CPU loss, or None where either is missing."""
    if result.loss is None or result.cpu_loss is None:
        return None
    return abs(result.loss - result.cpu_loss) / abs(result.cpu_loss)


def passed(result: Result, tolerance: float, min_agreement: float = MIN_AGREEMENT) -> bool:
    """Ran, its loss (where it has one) is within `tolerance` of CPU fp32's, and its greedy tokens (where it has
    them) agree with CPU fp32's at least `min_agreement` of the time."""
    if result.error is not None or (result.agreed is not None and result.agreed < min_agreement):
        return False
    diff = difference(result)
    return diff is None or diff <= tolerance


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_report(device: str, devices: int, precision: str, results: Sequence[Result], tolerance: float,
                  min_agreement: float = MIN_AGREEMENT) -> str:
    """The table the check prints, and its verdict line."""
    lines = [f"device check: {devices} x {device}, compute {precision}; reference: the same runs on CPU in fp32",
             f"{'check':<12} {'steps':>5} {'tokens/s':>10} {'MFU':>6} {'peak mem':>9} {'loss':>8} {'CPU fp32':>9} "
             f"{'diff':>7}  result"]
    for r in results:
        diff = difference(r)
        if r.error is not None:
            verdict = f"FAILED: {r.error}"
        elif r.agree is not None:
            verdict = f"greedy tokens agree with CPU fp32: {r.agree}" + (
                "" if passed(r, tolerance, min_agreement) else f", fewer than {min_agreement:.0%}")
        else:
            verdict = "ok" if passed(r, tolerance) else f"loss off by more than {tolerance:.0%}"
        memory = "-" if r.peak_memory_gb is None else f"{r.peak_memory_gb:.2f} GiB"
        lines.append(f"{r.name:<12} {r.steps:>5} {_cell(r.tokens_per_s, ',.0f'):>10} "
                     f"{'-' if r.mfu is None else f'{r.mfu:.1%}':>6} {memory:>9} {_cell(r.loss, '.4f'):>8} "
                     f"{_cell(r.cpu_loss, '.4f'):>9} {'-' if diff is None else f'{diff:.2%}':>7}  {verdict}")
    ok = all(passed(r, tolerance, min_agreement) for r in results)
    lines.append("verdict: every check ran, losses within " + f"{tolerance:.0%} of CPU fp32" if ok else
                 "verdict: FAILED (see the result column; each run's logs are in the work directory)")
    return "\n".join(lines)


def read_metrics(run_dir: str) -> Dict[str, Optional[float]]:
    """From a run's metrics.jsonl: the last logged training loss and step, tokens/s and MFU averaged over the logged
    intervals after the first (it holds the compilation), and the peak device memory."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [row for row in map(json.loads, f) if "loss" in row and "tokens_per_sec" in row]
    timed = rows[1:] or rows
    mean = lambda key: sum(r[key] for r in timed) / len(timed) if timed and key in timed[0] else None
    memory = [r["peak_device_memory_gb"] for r in rows if "peak_device_memory_gb" in r]
    return {"loss": rows[-1]["loss"] if rows else None, "step": rows[-1]["step"] if rows else 0,
            "tokens_per_s": mean("tokens_per_sec"), "mfu": mean("mfu"), "peak_memory_gb": max(memory, default=None)}


def instruction_samples(workdir: str) -> tuple:
    """Alpaca-format samples (a word and its reverse) for the SFT check, 64 to train on and 16 held out: its data,
    not a benchmark of quality. Returns the two files."""
    words = ["mindspore", "ascend", "tensor", "pipeline", "gradient", "optimizer", "token", "layer"]
    files = []
    for name, first, count in (("train", 0, 64), ("val", 64, 16)):
        files.append(os.path.join(workdir, f"instructions-{name}.jsonl"))
        with open(files[-1], "w", encoding="utf-8") as f:
            for i in range(first, first + count):
                word = words[i % len(words)] + str(i)
                f.write(json.dumps({"instruction": "Reverse the word.", "input": word, "output": word[::-1]}) + "\n")
    return tuple(files)


def train_overrides(check: str, device: str, precision: str, steps: int, run_dir: str, workdir: str,
                    init_from: Optional[str] = None) -> List[str]:
    """train.py's overrides for `check` on `device` (a preset name; cpu: the fp32 reference)."""
    common = [f"device={device}", f"precision={precision if device != 'cpu' else 'fp32'}", "logger.progress_bar=false",
              f"hydra.run.dir={run_dir}"]
    if check == "pretrain":
        return ["stage=tiny_pretrain", f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
                "trainer.log_every=10", *common]
    if check == "sft+lora":
        train, val = instruction_samples(workdir)
        return ["stage=sft", "peft=lora", "model=tiny", f"stage.init_from={init_from}", "data.seq_len=128",
                f"data.sources=[{{name: check, kind: alpaca, paths: ['{train}'], val_paths: ['{val}']}}]",
                "trainer.max_steps=4",
                "trainer.micro_batch_size=8", "trainer.log_every=2", "trainer.eval_every=4", *common]
    if check == "dp2xtp2xpp2":
        layout = [] if device == "cpu" else [
            "parallel=single", "parallel.name=dp2tp2pp2", *(f"parallel.{k}={v}" for k, v in LAYOUT.items())]
        rows = MICRO_BATCH * (1 if device != "cpu" else LAYOUT["dp"] * LAYOUT["micro_batches"])  # the same global batch
        return ["stage=tiny_pretrain", f"stage.init_from={init_from}", "trainer.max_steps=20", "trainer.eval_every=20",
                "trainer.log_every=10", f"trainer.micro_batch_size={rows}", *layout, *common]
    raise ValueError(f"no train.py check named {check}")


def run(command: List[str], log: str) -> Optional[str]:
    """Run `command` from the repository root, its output to `log`; None when it succeeded, else its last line."""
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code == 0:
        return None
    with open(log, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return (lines[-1] if lines else f"exit code {code}")[:200]


def train_check(check: str, device: str, precision: str, steps: int, workdir: str,
                init_from: Dict[str, str]) -> Result:
    """The check on the device, then on CPU in fp32 (the reference needs no accelerator, so it runs even when the
    device run failed: the report shows both)."""
    runs = {}
    for where in (device, "cpu"):
        run_dir = os.path.join(workdir, f"{check}-{where}")
        overrides = train_overrides(check, where, precision, steps, run_dir, workdir, init_from.get(where))
        error = run([sys.executable, os.path.join(ROOT, "train.py"), *overrides], f"{run_dir}.log")
        runs[where] = (error, run_dir)
    (error, run_dir), (cpu_error, cpu_dir) = runs[device], runs["cpu"]
    if error is None and cpu_error is not None:
        error = f"the CPU reference failed: {cpu_error}"
    if error is not None:
        return Result(check, error=error)
    ours, cpu = read_metrics(run_dir), read_metrics(cpu_dir)
    return Result(check, ours["step"], ours["tokens_per_s"], ours["mfu"], ours["peak_memory_gb"], ours["loss"],
                  cpu["loss"])


PROMPTS = ["def fibonacci(n):", "To be, or not to be", "import os\n", "class Tokenizer:"]


def generate_worker(checkpoint: str, target: str, precision: str, new_tokens: int) -> dict:
    """(In a process of its own, on `target`.) Greedy tokens of PROMPTS from `checkpoint` (a run directory or any
    form base/checkpoint.py resolves) as `python -m generate` builds the model: the tokens, decoding tokens/s and
    the peak device memory."""
    import mindspore as ms
    from omegaconf import OmegaConf

    import plugins
    from base.checkpoint import resolve
    from data.tokenizer import Tokenizer
    from models.common.generation import Generator
    from models.pretrained import build, graph_mode

    plugins.register()
    checkpoint = resolve(checkpoint)  # the run directory: its `latest` step
    cfg = OmegaConf.load(os.path.join(checkpoint, "config.yaml")).model
    graph_mode(target)
    model = build(cfg, checkpoint, target, precision)
    tokenizer = Tokenizer(os.path.join(checkpoint, "tokenizer.model"))
    result = Generator(model).generate([tokenizer.encode(p) for p in PROMPTS], new_tokens, eos_id=None)
    decoded = len(PROMPTS) * (result.timings["steps"] - 1)
    return {"tokens": [s.tokens for s in result.samples], "steps": result.timings["steps"],
            "tokens_per_s": decoded / max(result.timings["decode_s"], 1e-9),
            "peak_memory_gb": ms.runtime.max_memory_allocated() / 2**30 if as_device(target).memory_stats else None}


def agreement(ours: List[List[int]], cpu: List[List[int]]) -> str:
    """How many leading greedy tokens equal CPU fp32's, summed over the prompts: 'k of n'."""
    same = 0
    for a, b in zip(ours, cpu):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return f"{same} of {sum(map(len, cpu))}"


def generate_check(checkpoint: str, target: str, precision: str, workdir: str, new_tokens: int) -> Result:
    """Greedy tokens of `checkpoint` on the device, against the same checkpoint's on CPU in fp32."""
    outs = {}
    for where, dtype in ((target, precision), ("CPU", "fp32")):
        out = os.path.join(workdir, f"generate-{where}.json")
        command = [sys.executable, "-m", "benchmarks.device_check", "--generate-worker", checkpoint,
                   "--target", where, "--precision", dtype, "--new-tokens", str(new_tokens), "--out", out]
        error = run(command, out + ".log")
        if error is not None:
            return Result("generate", error=error if where == target else f"the CPU reference failed: {error}")
        with open(out, encoding="utf-8") as f:
            outs[where] = json.load(f)
    ours = outs[target]
    agree = agreement(ours["tokens"], outs["CPU"]["tokens"])
    same, total = map(int, agree.split(" of "))
    return Result("generate", ours["steps"], ours["tokens_per_s"], None, ours["peak_memory_gb"], agree=agree,
                  agreed=same / max(total, 1))


def preset_dtype(device: str) -> str:
    """The compute dtype of device preset `device` (conf/device/<device>.yaml), what precision=auto computes in."""
    from omegaconf import OmegaConf

    from base.errors import UsageError

    path = os.path.join(ROOT, "conf", "device", f"{device}.yaml")
    if not os.path.isfile(path):
        presets = sorted(name[:-5] for name in os.listdir(os.path.dirname(path)) if name.endswith(".yaml"))
        raise UsageError(f"--device: no preset {device!r} in conf/device/; choose one of {', '.join(presets)}")
    return OmegaConf.load(path).compute_dtype


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", help="the device preset (conf/device/; default: ascend910b on Ascend, h100 on GPU)")
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                        help="the device runs' compute dtype (auto: the preset's)")
    parser.add_argument("--steps", type=int, default=50, help="pretraining steps (default 50)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="relative loss difference allowed")
    parser.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT,
                        help="the share of greedy tokens that must equal CPU fp32's on the same checkpoint")
    parser.add_argument("--workdir", help="where the runs go (default: a temporary directory, removed on success)")
    parser.add_argument("--generate-worker", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--new-tokens", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generate_worker:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(generate_worker(args.generate_worker, args.target, args.precision, args.new_tokens), f)
        return 0
    target = accelerator()
    if target is None:
        print("device check: this machine has no Ascend or GPU device MindSpore can use; run it on the "
              "accelerator machine (on CPU, make test checks everything)", file=sys.stderr)
        return 1
    from base.validate import devices_here

    device = args.device or PRESETS[target]
    precision = preset_dtype(device) if args.precision == "auto" else args.precision
    workdir = args.workdir or tempfile.mkdtemp(prefix="mindlab-device-check-")
    os.makedirs(workdir, exist_ok=True)
    devices = devices_here(target)
    results = [train_check("pretrain", device, precision, args.steps, workdir, {})]
    pretrained = {"device": os.path.join(workdir, f"pretrain-{device}"), "cpu": os.path.join(workdir, "pretrain-cpu")}
    if results[0].error is None:
        results.append(train_check("sft+lora", device, precision, args.steps, workdir,
                                   {device: pretrained["device"], "cpu": pretrained["cpu"]}))
        results.append(generate_check(pretrained["device"], target, precision, workdir, args.new_tokens))
        if devices >= 8:  # both from the CPU pretraining's weights
            results.append(train_check("dp2xtp2xpp2", device, precision, args.steps, workdir,
                                       {device: pretrained["cpu"], "cpu": pretrained["cpu"]}))
    print(format_report(device, devices, precision, results, args.tolerance, args.min_agreement))
    ok = all(passed(r, args.tolerance, args.min_agreement) for r in results)
    if ok and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"runs: {workdir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
