"""What a tool that writes a directory may touch: only its own output.

    with output_dir("out/hf_model", "models.convert") as tmp:     # a whole directory, replaced atomically
        write_everything_into(tmp)
    with owned_files(sweep_dir, "sweeps.report", ["report.html", "curves.png"]):   # a few files in a shared one
        write_those_files()

A tool's output carries a marker file (MARKER, JSON: the tool and the files it wrote). `output_dir` writes into a
temporary sibling and renames it into place, so a reader never sees half an output and a failure leaves the
previous one; it replaces an existing directory only when that directory is empty or a previous output of the
same tool (its marker says so). Anything else — a user's notes beside it, their home directory — is refused in
one line naming it, before anything is written. `owned_files` does the same for named files inside a directory
that holds other things (a multirun directory's report): it overwrites a file of those names only when its own
marker lists it. A full disk during the write is one line too (base/errors.py `writing`).
"""
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, List, Sequence

from base.errors import UsageError, writing

MARKER = ".mindlab-output.json"


def _marker(directory: Path) -> dict:
    try:
        return json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _unmarked_own(directory: Path, entries: Sequence[str], own: Sequence[str]) -> bool:
    """An earlier output without a marker: `directory` holds nothing but files named in `own`."""
    return bool(own) and not _marker(directory) and all(n in own and (directory / n).is_file() for n in entries)


def check_output_dir(out: os.PathLike, tool: str, own: Sequence[str] = ()) -> None:
    """Refuse (UsageError, naming the directory and one foreign entry) an existing `out` that is neither empty nor
    a previous output of `tool`: its marker says so, or, without a marker, it holds nothing but files named in `own`
    (what the tool writes, e.g. a data set's train.jsonl, val.jsonl and stats.json)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory; give a new directory for {tool}'s output")
    if not out.is_dir() or _marker(out).get("tool") == tool:
        return
    entries = sorted(os.listdir(out), key=lambda name: (name.startswith("."), name))  # name a visible one first
    if entries and not _unmarked_own(out, entries, own):
        raise UsageError(f"{out}: exists and holds files that {tool} did not write (e.g. {entries[0]}); give a new "
                         f"or empty directory, or a previous output of {tool}: nothing there is replaced")


@contextlib.contextmanager
def output_dir(out: os.PathLike, tool: str, own: Sequence[str] = ()) -> Iterator[Path]:
    """A temporary directory to write `tool`'s whole output into; on success it replaces `out` atomically (with
    its marker), on failure it is removed and `out` is as it was. `own`: check_output_dir's."""
    out = Path(out)
    check_output_dir(out, tool, own)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would stay on the renamed directory
    try:
        with writing(str(out), lambda: _size(tmp), kept=f"{out} is as it was (the partial output is removed)"):
            yield tmp
            files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
            (tmp / MARKER).write_text(json.dumps({"tool": tool, "files": files}, indent=1), encoding="utf-8")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_owned_files(directory: os.PathLike, tool: str, names: Sequence[str], own: Sequence[str] = ()) -> List[str]:
    """The files of `directory` that `tool` wrote; UsageError naming the first of `names` there that it did not
    write. Its marker lists its files; without a marker, a directory holding nothing but files named in `own` (every
    name the tool writes there) is its earlier output."""
    directory = Path(directory)
    marker = _marker(directory)
    ours: List[str] = marker.get("files", []) if marker.get("tool") == tool else []
    entries = os.listdir(directory) if directory.is_dir() else []
    if _unmarked_own(directory, entries, own):
        ours = entries
    foreign = [n for n in names if (directory / n).exists() and n not in ours]
    if foreign:
        raise UsageError(f"{directory / foreign[0]}: exists and was not written by {tool}; move it away (it is "
                         "not replaced)")
    return ours


@contextlib.contextmanager
def owned_files(directory: os.PathLike, tool: str, names: Sequence[str], own: Sequence[str] = ()) -> Iterator[None]:
    """Write the files `names` into `directory` (which holds other things): each may replace a file only if this
    tool wrote it (check_owned_files); the marker then lists them all."""
    directory = Path(directory)
    ours = check_owned_files(directory, tool, names, own)
    with writing(str(directory), lambda: sum((directory / n).stat().st_size for n in names
                                             if (directory / n).is_file())):
        yield
        (directory / MARKER).write_text(json.dumps({"tool": tool, "files": sorted(set(ours) | set(names))},
                                                   indent=1), encoding="utf-8")


HYDRA_WRITES = (".hydra", "train.log")  # what Hydra puts into a run directory before the run starts
# what the other nodes of a multi-node run may already have written into the shared run dir when node 0 checks it:
# their launch's worker logs (distributed/launch.py) and Hydra's files
OTHER_NODES_WRITE = ("workers",)


def check_run_dir(run_dir: os.PathLike) -> None:
    """A training run writes into a new directory or an earlier run's (status.json, written first, marks one:
    it resumes there); a directory holding anything else is refused naming it, e.g. hydra.run.dir=$HOME."""
    from base.errors import ConfigError

    run_dir = Path(run_dir)
    entries = set(os.listdir(run_dir)) if run_dir.is_dir() else set()
    foreign = sorted(entries - set(HYDRA_WRITES) - set(OTHER_NODES_WRITE), key=lambda name: (name.startswith("."), name))
    if foreign and "status.json" not in entries:
        raise ConfigError("hydra.run.dir", f"{run_dir} holds files that are not a mindlab run's (e.g. {foreign[0]}); "
                          "give a new directory, e.g. hydra.run.dir=outputs/my_run (hydra.sweep.dir with -m)")


@contextlib.contextmanager
def file_lock(path: os.PathLike) -> Iterator[None]:
    """An exclusive lock on the file `path` (made if missing) for the block: processes that share a directory,
    on this machine or over a shared file system with flock, take turns."""
    with open(path, "a") as f:  # "a": taking the lock does not touch the file
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
