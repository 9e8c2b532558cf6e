"""benchmarks/RESULTS.md: one current section per benchmark, written by the benchmark itself (its `--results`
flag or its default), stamped with the machine, the date and the commit it measured. A section is replaced whole
by the next run of its benchmark; the others are kept.
"""
import contextlib
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from base.paths import REPO_ROOT

# MINDLAB_RESULTS: another file (`python -m benchmarks --smallest` checks that the benchmarks run, and writes there)
RESULTS = Path(os.environ.get("MINDLAB_RESULTS") or REPO_ROOT / "benchmarks" / "RESULTS.md")
HEAD = ("# Benchmark results\n\nEach section is written by the benchmark named in its title (run it to measure again "
        "on your machine); the line under the title says where and when it was measured.\n")


def machine() -> str:
    """CPU model and cores (and the accelerator where there is one: the device preset says which)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"


def commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"], capture_output=True,
                          text=True)
    return done.stdout.strip() or "unknown"


def write_section(name: str, title: str, body: str) -> None:
    """Replace (or add) the section of benchmark `name` (its module, e.g. benchmarks.speed_memory): `title`, the
    stamp, then `body` (markdown)."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    # the load says whether timings were taken on a quiet machine (about 1 per busy core) or beside other work
    stamp = (f"_{machine()}, load {os.getloadavg()[1]:.1f} over the last 5 minutes; {datetime.date.today().isoformat()}; "
             f"commit {commit()}; `python -m {name}`_")
    block = f"{begin}\n## {title}\n\n{stamp}\n\n{body.strip()}\n{end}"
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else HEAD
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    RESULTS.write_text(text, encoding="utf-8")
    print(f"[results] {RESULTS}: {title}")


class _Tee:
    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, text: str) -> int:
        self.text.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def recorded(name: str, title: str) -> Iterator[None]:
    """What the benchmark prints inside the block, printed as usual and, when it ends without an error, written as
    its section of benchmarks/RESULTS.md (a benchmark writes what it measured, never a hand-copied table)."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):  # a help text is no measurement
        yield
        return
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield
    except SystemExit as done:  # a main that ends with sys.exit: a clean exit is a finished measurement
        if done.code not in (None, 0):
            raise
    finally:
        sys.stdout = tee.stream
    printed = "".join(tee.text).strip()
    if printed:
        write_section(name, title, "```\n" + printed + "\n```")
