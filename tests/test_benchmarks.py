"""The benchmarks the docs name run, and benchmarks/RESULTS.md has a section for each: `python -m benchmarks`
(benchmarks/__main__.py) is the one command that runs them all, and here each runs at its smallest setting."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

ROOT = Path(ROOT)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# needs an accelerator: it runs as `make device-check` on one (tests/test_device_check.py checks it on CPU)
HARDWARE = {"device_check"}


def documented() -> set:
    return {m for doc in DOCS for m in re.findall(r"python -m benchmarks\.(\w+)", doc.read_text(encoding="utf-8"))}


def sections(path: Path) -> set:
    return set(re.findall(r"<!-- benchmarks\.(\w+): begin -->", path.read_text(encoding="utf-8")))


def test_python_m_benchmarks_runs_every_benchmark_the_docs_name():
    from benchmarks.__main__ import BENCHMARKS

    assert documented() - HARDWARE == set(BENCHMARKS)


def test_results_md_has_a_section_for_every_benchmark_the_docs_name():
    missing = documented() - HARDWARE - sections(RESULTS)
    assert not missing, f"no section in benchmarks/RESULTS.md: {sorted(missing)} (run `python -m benchmarks NAME`)"


def test_cpu_matmul_peak_json_is_the_json_alone_and_leaves_results_md_as_it_is():
    """speed_memory and scaling parse the last line cpu_matmul_peak --json prints: it is the JSON, nothing after."""
    from benchmarks.speed_memory import measured_peak_flops, peak_line

    before = RESULTS.read_text(encoding="utf-8")
    peak = measured_peak_flops("64,128")
    assert RESULTS.read_text(encoding="utf-8") == before
    assert peak["peak"] == max(peak[lib] for lib in ("mindspore", "pytorch", "numpy", "onednn")) > 0
    assert peak["sizes"] == [64, 128] and peak[peak["by"]] == peak["peak"]
    assert "n in 64/128" in peak_line(peak)
    out = subprocess.run([sys.executable, "-m", "benchmarks.cpu_matmul_peak", "--json", "--sizes", "64"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    assert len(out.strip().splitlines()) == 1 and json.loads(out)["sizes"] == [64]


@pytest.fixture(scope="module")
def smallest(tmp_path_factory):
    """Where `python -m benchmarks --smallest` keeps its checkpoints (made once, reused by every benchmark)."""
    return tmp_path_factory.mktemp("benchmarks")


@pytest.mark.slow
@pytest.mark.benchmarks
@pytest.mark.parametrize("name", sorted(documented() - HARDWARE))
def test_each_benchmark_runs_at_its_smallest_setting_and_writes_its_section(name, smallest):
    """The command as the docs' `python -m benchmarks` runs it, at the least of everything (a few steps of the
    tiny model): it exits 0 and writes its section, into another file than the repository's RESULTS.md."""
    results = smallest / f"{name}.md"
    before = RESULTS.read_text(encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "benchmarks", name, "--smallest", "--results", str(results),
                           "--workdir", str(smallest / "work")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert sections(results) == {name}
    assert RESULTS.read_text(encoding="utf-8") == before
