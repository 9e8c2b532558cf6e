"""prepare at scale: work units, dedup a batch at a time, a killed prepare resumed, parts then the merge, bad
input in the middle of a source, and worker processes that die with their parent. Each compares with what one
uninterrupted prepare (or a document-at-a-time reference) gives."""
import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from omegaconf import OmegaConf

import data.sources
from data import DataError
from data.cache import cache_key, prepare, prepare_step
from data.dedup import Deduplicator, SortedKeys
from data.documents import Work, clean
from data.minhash import NUM_PERM, lsh_bands
from data.parallel import WorkerPool
from data.sources import read_unit, work_units
from conftest import invoke, write_docs
from helpers import digests_of, make_docs, source_cfg

REPO = Path(__file__).resolve().parents[1]


# --- work units -----------------------------------------------------------------------------------------

def test_big_jsonl_splits_into_line_aligned_units_that_read_like_the_file(tmp_path, monkeypatch):
    docs = make_docs(5, 300)
    write_docs(tmp_path / "big.jsonl", docs)
    size = (tmp_path / "big.jsonl").stat().st_size
    monkeypatch.setattr(data.sources, "UNIT_BYTES", size // 7)
    source = source_cfg(name="s", kind="jsonl", paths=[str(tmp_path / "big.jsonl")])
    units = work_units(source)
    assert len(units) == 8 and sum(u.size for u in units) == size
    assert [d for u in units for d in read_unit(source, u)] == [d for d in docs if d.strip()]
    lines = (tmp_path / "big.jsonl").read_bytes().split(b"\n")
    lines[289] = b'{"text": broken'  # in the last unit: the error names the file's own line number
    (tmp_path / "big.jsonl").write_bytes(b"\n".join(lines))
    *before, last = work_units(source)
    assert last.pieces[0].start > 0 and len([d for u in before for d in read_unit(source, u)]) < 289
    with pytest.raises(DataError, match=r"big.jsonl:290: invalid JSON"):
        list(read_unit(source, last))


def test_small_files_group_into_units_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(data.sources, "UNIT_BYTES", 1000)
    for i in range(5):
        (tmp_path / f"f{i}.jsonl").write_text(json.dumps({"text": "x" * 450}) + "\n")
    units = work_units(source_cfg(name="s", kind="jsonl", paths=[str(tmp_path / "f*.jsonl")]))
    assert [[Path(p.path).name for p in u.pieces] for u in units] == [["f0.jsonl", "f1.jsonl", "f2.jsonl"],
                                                                      ["f3.jsonl", "f4.jsonl"]]


# --- dedup ----------------------------------------------------------------------------------------------

def reference_dedup(digests, signatures, threshold):
    """A document at a time: the first copy stays; a near duplicate of a kept document (a shared LSH band and
    >= threshold equal signature entries) goes. The batch version must agree exactly."""
    bands, rows = lsh_bands(threshold)
    seen, buckets, kept_sigs, out = set(), {}, [], []
    for digest, sig in zip(digests, signatures):
        if digest in seen:
            out.append(1)
            continue
        seen.add(digest)
        keys = [(b, sig[b * rows:(b + 1) * rows].tobytes()) for b in range(bands)]
        candidates = {i for key in keys for i in buckets.get(key, ())}
        if any(np.mean(kept_sigs[i] == sig) >= threshold for i in candidates):
            out.append(2)
            continue
        for key in keys:
            buckets.setdefault(key, []).append(len(kept_sigs))
        kept_sigs.append(sig)
        out.append(0)
    return out


def test_batched_dedup_matches_the_document_at_a_time_reference():
    rng = np.random.default_rng(0)
    n = 3000
    sigs = rng.integers(0, 2 ** 32, (n, NUM_PERM), dtype=np.uint32)
    digests = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(n)]
    for i in rng.choice(np.arange(100, n), 300, replace=False):  # copies of earlier documents, some edited
        j = int(rng.integers(0, i))
        sigs[i] = sigs[j]
        k = int(rng.integers(0, 4))
        if k == 0:
            digests[i] = digests[j]  # exact
        else:  # near: ~3, ~15, ~40 of 128 entries differ (the last below the threshold)
            changed = rng.choice(NUM_PERM, [3, 15, 40][k - 1], replace=False)
            sigs[i, changed] = rng.integers(0, 2 ** 32, len(changed), dtype=np.uint32)
    cfg = OmegaConf.create({"exact_dedup": True, "near_dedup": True, "near_dedup_threshold": 0.8})
    expected = reference_dedup(digests, sigs, 0.8)
    assert 20 < expected.count(2) < 300 and expected.count(1) > 50
    dedup = Deduplicator(cfg, lambda i: sigs[i])
    got = []
    for start in range(0, n, 700):  # batches: near copies within a batch and across batches
        got += dedup.offer(np.array(digests[start:start + 700], "S16"), sigs[start:start + 700]).tolist()
    assert got == expected


def test_sorted_keys_finds_every_copy_of_a_key():
    keys = SortedKeys()
    for batch in ([5, 3, 9], [3, 7], [1, 2, 3, 4], [9]):
        keys.add(np.array(batch, np.uint64), np.array([10 * k for k in batch], np.int64))
    i, v = keys.find(np.array([3, 8, 9], np.uint64))
    assert sorted(zip(i.tolist(), v.tolist())) == [(0, 30), (0, 30), (0, 30), (2, 90), (2, 90)]
    assert len(keys._runs) <= 3  # merged as it grew


# --- resuming and fanning out ---------------------------------------------------------------------------

def test_parts_then_the_merge_write_the_bytes_of_one_prepare(many_units, tmp_path):
    cfg, docs = many_units
    one = prepare(cfg)
    parted = OmegaConf.merge(cfg, {"cache_dir": str(tmp_path / "parts")})
    with pytest.raises(DataError, match="needs the plan.*step=plan"):
        prepare_step(parted, "tokenize", (0, 2))
    for i in (2, 0, 1):  # any order
        assert "cleaned" in prepare_step(parted, "clean", (i, 3))
    assert "0 of its" in prepare_step(parted, "clean", (1, 3))  # a part run again does nothing
    prepare_step(parted, "plan")
    for i in (1, 0):
        prepare_step(parted, "tokenize", (i, 2))
    merged = prepare(parted)
    assert digests_of(merged.dir) == digests_of(one.dir)
    assert one.meta["sources"]["b"]["removed"]["near_dedup"] == 1  # found across parts and sources
    assert not (tmp_path / "parts" / f"{cache_key(parted)}.work").exists() and not (tmp_path / "parts" / "units").exists()


def test_a_new_val_fraction_reuses_the_cleaned_units(many_units):
    cfg, _ = many_units
    work = Work.of(cfg, cache_key(cfg))
    with WorkerPool(0) as pool:
        assert clean(cfg, work, (0, 1), pool) == len(work.units) > 5
    stamps = {d: d.stat().st_mtime_ns for d in work.unit_dirs}
    other = OmegaConf.merge(cfg, {"val_fraction": 0.3})
    work2 = Work.of(other, cache_key(other))
    assert work2.unit_dirs == work.unit_dirs
    with WorkerPool(0) as pool:
        assert clean(other, work2, (0, 1), pool) == 0
    assert {d: d.stat().st_mtime_ns for d in work.unit_dirs} == stamps


def test_a_build_that_finishes_keeps_the_units_another_build_is_reading(many_units):
    """Two cache keys over the same files share cleaned units; the first to merge removes only the units no
    unfinished build has claimed, so the other one's tokenize still finds them."""
    cfg, _ = many_units
    other = OmegaConf.merge(cfg, {"val_fraction": 0.3})
    work2 = Work.of(other, cache_key(other))
    with WorkerPool(0) as pool:
        clean(other, work2, (0, 2), pool)  # the other build is half-way
    prepare(cfg)
    assert all(d.is_dir() for d in work2.unit_dirs)
    prepare(other)
    assert not (Path(cfg.cache_dir) / "units").exists()

KILLABLE = """
import sys, time
import data.sources, data.packing
data.sources.UNIT_BYTES = 3 * 4000
{slow}
from prepare import main
sys.exit(main(sys.argv[1:]))
"""


def prepare_args(cfg):
    """prepare.py's command line for `cfg`'s sources (its other keys as data_cfg and many_units set them)."""
    sources = "[" + ", ".join(f"{{name: {s.name}, kind: {s.kind}, paths: ['{s.paths[0]}']}}" for s in cfg.sources) + "]"
    return [f"data.sources={sources}", f"data.cache_dir={cfg.cache_dir}", "data.num_workers=0", "data.seq_len=16",
            "data.shard_rows=500", "data.val_fraction=0.1", "model.vocab_size=300",
            "data.tokenizer.sample_chars=100000", "data.cleaning.min_chars=10"]


def prepare_main(cfg):
    """prepare.py's main on `cfg`'s sources in this process (many_units sets the same small units as KILLABLE): a
    run that is not killed needs no process of its own."""
    outcome = invoke("prepare", prepare_args(cfg))
    assert outcome.code == 0, outcome.err[-3000:]


def kill_prepare(cfg, slow, kill_when):
    """prepare.py in a subprocess on `cfg`'s sources (small units, `slow` patched in), SIGKILLed once kill_when()
    holds."""
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE.format(slow=textwrap.dedent(slow)), *prepare_args(cfg)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not kill_when() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


@pytest.mark.slow
def test_a_killed_prepare_resumes_to_the_bytes_of_an_uninterrupted_one(many_units, tmp_path):
    cfg, _ = many_units
    prepare_main(cfg)
    (uninterrupted,) = [p for p in Path(cfg.cache_dir).iterdir() if p.is_dir()]
    expected = digests_of(uninterrupted)
    for stage, slow, done in [  # killed once some units are cleaned, then once some row shards are written
            ("clean", "import data.documents as d; c = d.clean_unit\n"
                      "d.clean_unit = lambda *a: (time.sleep(0.3), c(*a))[1]",
             lambda cache: len([p for p in (cache / "units").glob("*") if ".tmp-" not in p.name]) >= 3),
            ("pack", "w = data.packing._write_shard\n"
                     "data.packing._write_shard = lambda *a: (time.sleep(0.2), w(*a))[1]",
             lambda cache: len(list(cache.glob("*/rows-16.partial/*.mindrecord"))) >= 2)]:
        killed = OmegaConf.merge(cfg, {"cache_dir": str(tmp_path / f"killed-{stage}")})
        kill_prepare(killed, slow, kill_when=lambda: done(Path(killed.cache_dir)))
        finished = {p.name for p in Path(killed.cache_dir).rglob("*") if ".tmp-" not in p.name}
        prepare_main(killed)  # resumed
        (resumed,) = [p for p in Path(killed.cache_dir).iterdir() if p.is_dir()]
        assert digests_of(resumed) == expected, stage
        assert finished  # something was kept to resume from


# --- bad input in the middle of a source ---------------------------------------------------------------

def test_a_truncated_gz_mid_source_names_the_file_and_keeps_the_finished_units(many_units, tmp_path):
    cfg, docs = many_units
    bad = tmp_path / "a-005.jsonl"  # in the second unit of source a
    good = bad.read_bytes()
    bad.unlink()
    gz = tmp_path / "a-005.jsonl.gz"
    gz.write_bytes(gzip.compress(good)[:-20])
    cfg = OmegaConf.merge(cfg, {"sources": [{"name": "a", "kind": "jsonl", "paths": [str(tmp_path / "a-*")]},
                                            cfg.sources[1]]})
    with pytest.raises(DataError, match=r"a-005.jsonl.gz: cannot read it (after line \d )?\(Compressed file ended"):
        prepare(cfg)
    kept = {p.name for p in (Path(cfg.cache_dir) / "units").iterdir()}
    assert len(kept) == 1 and not any(".tmp-" in k for k in kept)  # the first unit, finished before
    gz.write_bytes(gzip.compress(good))  # fixed: the next run continues from the finished unit
    first = next((Path(cfg.cache_dir) / "units").iterdir())
    stamp = first.stat().st_mtime_ns
    with WorkerPool(0) as pool:
        work = Work.of(cfg, cache_key(cfg))
        assert work.unit_dirs[0] == first and clean(cfg, work, (0, 1), pool) == len(work.units) - 1
    assert first.stat().st_mtime_ns == stamp


def test_a_file_gone_between_listing_and_reading_is_named(many_units, tmp_path):
    cfg, _ = many_units
    work = Work.of(cfg, cache_key(cfg))  # lists the files
    (tmp_path / "a-003.jsonl").unlink()
    with WorkerPool(0) as pool, pytest.raises(DataError, match=r"a-003.jsonl: no such file any more.*restore it"):
        clean(cfg, work, (0, 1), pool)


def test_a_full_disk_while_writing_a_shard_is_one_error_and_keeps_the_finished_shards(corpus, monkeypatch):
    import data.packing

    cfg, _ = corpus
    cfg = OmegaConf.merge(cfg, {"shard_rows": 30})
    calls, fail_at = [], [2]
    real = data.packing.FileWriter.commit

    def commit(self):
        calls.append(1)
        if len(calls) == fail_at[0]:  # what MindRecord raises when the disk is full
            raise RuntimeError("Exception thrown from dataset pipeline. [ERROR] No free disk to be used while "
                               "writing mindrecord files, available free disk size: 2")
        return real(self)

    monkeypatch.setattr(data.packing.FileWriter, "commit", commit)
    with pytest.raises(DataError, match=r"a.train.00001.mindrecord: cannot write it \(no space left"):
        prepare(cfg)
    partial = next(Path(cfg.cache_dir).glob("*/rows-32.partial"))
    assert sorted(p.name for p in partial.iterdir()) == ["a.train.00000.mindrecord", "a.train.00000.mindrecord.db"]
    fail_at[0] = 0  # space freed
    prepared = prepare(cfg)
    shards = list(prepared.rows_dir.glob("*.mindrecord"))
    assert len(calls) - 2 == len(shards) - 1 > 2  # every shard but the finished one was written


# --- workers ---------------------------------------------------------------------------------------------

ORPHAN = """
import os, sys, time
from data.parallel import WorkerPool

def nap(seconds, marker):
    open(marker, "w").close()
    time.sleep(seconds)

if __name__ == "__main__":
    with WorkerPool(2) as pool:
        for _ in pool.run(nap, [(600, sys.argv[1] + "/napping-0"), (600, sys.argv[1] + "/napping-1")], "nap", 1):
            pass
"""


def test_worker_processes_die_with_a_killed_parent(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    parent = psutil.Process(proc.pid)
    deadline = time.time() + 120
    while len(list(tmp_path.glob("napping-*"))) < 2:  # both workers in their task (past their start-up)
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    children = parent.children(recursive=True)
    assert len(children) >= 3, children  # 2 workers + the resource tracker
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert alive == [], [p.cmdline() for p in alive]
