"""prepare at corpus scale: peak memory and throughput per step on generated corpora of a few GB, side by side
with another checkout's prepare (the code before streaming), and the two properties a long prepare relies on:
kill -9 at a random moment then rerun, and n parts then the merge, each give the bytes of one uninterrupted
run.

    scripts/venv.sh python -m benchmarks.prepare_scale --sizes 0.5 1 2 4 --old /tmp/old-checkout --old-sizes 0.5 1

Corpora (`--work`, default /tmp/prepare_scale; each is deleted after its size is measured): JSONL files of 256
MB holding documents of 15-60 lines drawn at random from the lines of ../shared/corpora (MINDLAB_CORPORA), so
nearly all are unique; 1% are exact copies of an earlier document and 1% near copies (one line changed), for
dedup to find. MB are 10^6 bytes of UTF-8 text read (meta.json's bytes_read). This checkout runs one process
per step (clean, plan, tokenize, then the merge and the rows, as a Slurm fan-out does with one part) so that
each step's peak is its own; the old checkout runs once, its steps' peaks cut from the sampled memory by the
timings in its meta.json. The table goes to benchmarks/RESULTS.md (benchmarks/results.py). Memory is sampled
every 0.2 s: the RSS of the prepare process and the sum over it and its workers (which counts shared libraries
once per process: an upper bound). This box is shared: a step's mean 1-minute load average is printed beside
its time, and its CPU seconds (the process and the workers it waited for), which other processes' load sways
much less than the wall clock.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil

from benchmarks.results import recorded

REPO = Path(__file__).resolve().parents[1]
CORPORA = Path(os.environ.get("MINDLAB_CORPORA", REPO.parent / "shared" / "corpora"))
FILE_BYTES = 256 * 10 ** 6
OVERRIDES = ["model=small", "data=default", "data.num_workers=2"]
STEPS = [["step=clean"], ["step=plan"], ["step=tokenize"], []]  # the last: merge + rows
STEP_NAMES = ["clean", "plan", "tokenize", "merge+pack"]


def make_corpus(out: Path, size: int, seed: int = 0) -> List[Path]:
    """JSONL files totalling about `size` bytes of documents made of random lines of the shared corpora."""
    lines = []
    for path in sorted(CORPORA.glob("*/*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for record in f:
                lines += [line for line in json.loads(record)["text"].split("\n") if len(line.strip()) >= 20]
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    files, written, earlier = [], 0, []
    f = None
    while written < size:
        if f is None or f.tell() >= FILE_BYTES:
            f and f.close()
            files.append(out / f"web-{len(files):05d}.jsonl")
            f = open(files[-1], "w", encoding="utf-8")
        roll = rng.random()
        if roll < 0.01 and earlier:
            text = rng.choice(earlier)  # an exact copy
        elif roll < 0.02 and earlier:
            doc = rng.choice(earlier).split("\n")
            doc[rng.randrange(len(doc))] = rng.choice(lines)
            text = "\n".join(doc)  # a near copy
        else:
            text = "\n".join(rng.choice(lines) for _ in range(rng.randint(15, 60)))
            if rng.random() < 0.01:
                earlier = (earlier + [text])[-1000:]
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        f.write(line)
        written += len(line.encode())
    f.close()
    return files


class Sampler:
    """Peak RSS of a process and of it with its descendants, sampled every 0.2 s in a thread, with a timeline."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.timeline: List[tuple] = []  # (seconds since start, main RSS, tree RSS, 1-minute load average)
        self._stop = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                main = self.proc.memory_info().rss
                tree = main + sum(c.memory_info().rss for c in self.proc.children(recursive=True)
                                  if c.is_running())
                self.timeline.append((time.perf_counter() - self._start, main, tree, os.getloadavg()[0]))
            except psutil.Error:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float = 0.0, stop: float = float("inf")) -> tuple:
        inside = [(m, t) for s, m, t, _ in self.timeline if start <= s <= stop] or [(0, 0)]
        return max(m for m, _ in inside) / 1e9, max(t for _, t in inside) / 1e9

    def load(self) -> float:
        """The mean 1-minute load average while it ran: above ~3 (itself and 2 workers), others were busy too."""
        return sum(x[3] for x in self.timeline) / max(len(self.timeline), 1)


def run(cwd: Path, args: List[str], kill_after: Optional[float] = None) -> dict:
    """Run prepare.py in `cwd`; wall seconds, peak memory, the timeline and when each stdout line came."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "prepare.py", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    sampler = Sampler(proc.pid)
    lines = []
    reader = threading.Thread(target=lambda: [lines.append((time.perf_counter() - start, line.rstrip()))
                                              for line in proc.stdout], daemon=True)
    reader.start()
    survivors = None
    try:
        proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        survivors = len(psutil.wait_procs(children, timeout=10)[1])  # its workers must die with it
    reader.join()
    sampler.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run and the workers it waited for
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"code": proc.returncode, "wall": time.perf_counter() - start, "cpu": cpu, "sampler": sampler,
            "lines": lines, "survivors": survivors}


def output_digest(cache: Path) -> Dict[str, str]:
    """sha256 of every file of the prepared cache (the one key dir), meta.json and index.json without timings."""
    (root,) = [p for p in cache.iterdir() if p.is_dir() and len(p.name) == 12]
    digests = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if path.name in ("meta.json", "index.json"):
            record = json.loads(data)
            record.pop("seconds")
            data = json.dumps(record, sort_keys=True).encode()
        digests[str(path.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return digests


def mb_read(cache: Path) -> float:
    (meta,) = cache.glob("*/meta.json")
    return sum(m["bytes_read"] for m in json.loads(meta.read_text())["sources"].values()) / 1e6


def measure_new(files: List[Path], cache: Path) -> dict:
    overrides = OVERRIDES + [source_override(files), f"data.cache_dir={cache}"]
    steps = {}
    for name, extra in zip(STEP_NAMES, STEPS):
        result = run(REPO, overrides + extra)
        assert result["code"] == 0, f"{name} failed"
        steps[name] = {"wall": result["wall"], "cpu": result["cpu"], "load": result["sampler"].load(),
                       "peak": result["sampler"].peak()}
        print(f"  new {name}: {result['wall']:.0f} s ({result['cpu']:.0f} CPU s, load {steps[name]['load']:.1f}), "
              f"peak RSS main {steps[name]['peak'][0]:.2f} GB, with workers {steps[name]['peak'][1]:.2f} GB",
              flush=True)
    return steps


def measure_old(old: Path, files: List[Path], cache: Path) -> dict:
    result = run(old, OVERRIDES + [source_override(files), f"data.cache_dir={cache}"])
    assert result["code"] == 0, "the old prepare failed"
    (meta,) = cache.glob("*/meta.json")
    seconds = json.loads(meta.read_text())["seconds"]
    starts = [t for t, line in result["lines"] if line.startswith("[data] building")]
    sampler, steps, at = result["sampler"], {}, starts[0]
    for name in ("read", "clean_and_dedup", "tokenizer", "tokenize"):
        steps[name] = {"wall": seconds[name], "peak": sampler.peak(at, at + seconds[name])}
        at += seconds[name]
    steps["pack"] = {"wall": result["wall"] - starts[1], "peak": sampler.peak(starts[1])}
    steps["total"] = {"wall": result["wall"], "cpu": result["cpu"], "load": sampler.load(), "peak": sampler.peak()}
    for name, s in steps.items():
        print(f"  old {name}: {s['wall']:.0f} s, peak RSS main {s['peak'][0]:.2f} GB, with workers "
              f"{s['peak'][1]:.2f} GB", flush=True)
    print(f"  old: {result['cpu']:.0f} CPU s, load {steps['total']['load']:.1f}", flush=True)
    return steps


def source_override(files: List[Path]) -> str:
    return f"data.sources=[{{name: web, kind: jsonl, paths: ['{files[0].parent}/web-*.jsonl']}}]"


def check_kill_and_parts(files: List[Path], work: Path, reference: Dict[str, str], wall: float, seed: int) -> dict:
    """A prepare killed at a random moment then rerun, and 2 parts per step, against the reference bytes."""
    overrides = OVERRIDES + [source_override(files)]
    rng = random.Random(seed)
    killed = work / "cache-killed"
    at = rng.uniform(5, 0.9 * wall)
    survivors = run(REPO, overrides + [f"data.cache_dir={killed}"], kill_after=at)["survivors"]
    left = sorted(str(p.relative_to(killed)) for p in killed.rglob("*") if p.is_dir())
    assert run(REPO, overrides + [f"data.cache_dir={killed}"])["code"] == 0
    same_after_kill = output_digest(killed) == reference
    shutil.rmtree(killed)
    parts = work / "cache-parts"
    for step in ("clean", "plan", "tokenize"):
        for i in ((0, 1) if step != "plan" else (None,)):
            args = [f"step={step}"] + ([f"part={i}/2"] if i is not None else [])
            assert run(REPO, overrides + [f"data.cache_dir={parts}", *args])["code"] == 0
    assert run(REPO, overrides + [f"data.cache_dir={parts}"])["code"] == 0
    same_parts = output_digest(parts) == reference
    shutil.rmtree(parts)
    print(f"  killed at {at:.0f} s ({survivors} of its processes outlived it; it left {len(left)} directories), "
          f"rerun: same bytes {same_after_kill}; 2 parts + merge: same bytes {same_parts}", flush=True)
    return {"killed_at": at, "survivors": survivors, "same_after_kill": same_after_kill, "same_parts": same_parts}


def table(rows: Dict[float, dict]) -> str:
    out = ["| corpus | code | step | s | MB/s | CPU s | load | peak RSS, GB (process / with workers) |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for size, r in rows.items():
        for code in ("old", "new"):
            if code not in r:
                continue
            for step, s in r[code].items():
                cpu, load = (f"{s['cpu']:.0f}", f"{s['load']:.1f}") if "cpu" in s else ("", "")
                out.append(f"| {size:g} GB ({r['mb']:.0f} MB read) | {code} | {step} | {s['wall']:.0f} | "
                           f"{r['mb'] / max(s['wall'], 1e-9):.2f} | {cpu} | {load} | "
                           f"{s['peak'][0]:.2f} / {s['peak'][1]:.2f} |")
        if "check" in r:
            c = r["check"]
            out.append(f"| {size:g} GB | new | kill -9 at {c['killed_at']:.0f} s ({c['survivors']} workers outlived "
                       f"it), rerun: same bytes | {c['same_after_kill']} | | | | |")
            out.append(f"| {size:g} GB | new | 2 parts + merge: same bytes | {c['same_parts']} | | | | |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1, 2, 4], help="GB of JSONL")
    parser.add_argument("--old", type=Path, help="a checkout of the prepare to compare with")
    parser.add_argument("--old-sizes", type=float, nargs="*", default=[0.5, 1], help="sizes the old one runs at")
    parser.add_argument("--check-size", type=float, default=0.5, help="size of the kill and parts checks")
    parser.add_argument("--work", type=Path, default=Path("/tmp/prepare_scale"))
    args = parser.parse_args()
    rows: Dict[float, dict] = {}
    for size in args.sizes:
        corpus = args.work / f"corpus-{size:g}"
        print(f"corpus {size:g} GB: generating", flush=True)
        files = make_corpus(corpus, int(size * 1e9))
        row = rows[size] = {}
        if args.old and size in args.old_sizes:
            cache = args.work / "cache-old"
            row["old"] = measure_old(args.old, files, cache)
            row["mb"] = mb_read(cache)
            shutil.rmtree(cache)
        cache = args.work / "cache-new"
        row["new"] = measure_new(files, cache)
        steps = list(row["new"].values())
        row["new"]["total"] = {"wall": sum(s["wall"] for s in steps), "cpu": sum(s["cpu"] for s in steps),
                               "load": sum(s["load"] * s["wall"] for s in steps) / sum(s["wall"] for s in steps),
                               "peak": tuple(max(s["peak"][i] for s in steps) for i in (0, 1))}
        row["mb"] = mb_read(cache)
        if size == args.check_size:
            row["check"] = check_kill_and_parts(files, args.work, output_digest(cache), row["new"]["total"]["wall"],
                                                seed=int(time.time()))
        shutil.rmtree(cache)
        shutil.rmtree(corpus)
        print(table(rows), flush=True)
    with recorded("benchmarks.prepare_scale", "prepare at corpus scale: memory and throughput per step"):
        print(table(rows))


if __name__ == "__main__":
    main()
