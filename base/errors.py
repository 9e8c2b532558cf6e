"""The error contract of every entry point: a user error is one line, a bug keeps its traceback.

A user error is something the user can fix — a config value, a missing/unreadable/corrupt file, the wrong
kind of checkpoint, a missing credential, a layout this machine cannot run. It is raised as a `UserError`
(ConfigError, UsageError, CheckpointError, DiskFull here; data.DataError, evaluation.tasks.TaskError,
trainer.guard.TrainingStopped) whose message names the key or file and the fix. Each CLI's `main(argv)` is
wrapped in `entry_point`, which prints such an error as `error: <what>, <where>; <how to fix>` (`config
error: ...` for config values) and returns its exit code — 2 for what was typed (a value, a path, an
argument), 1 for a file or the environment; anything else is a bug and propagates with its traceback.
Shared by base/validate.py, the plug-ins' own checks and every CLI; tests/test_errors.py is the table.
"""
import argparse
import contextlib
import errno
import functools
import os
import shutil
import sys
import traceback
from typing import Callable, Iterator, Optional, Sequence, Tuple, Union


class UserError(Exception):
    """A problem the user can fix; the message names the key or file and the fix (one line)."""

    prefix = "error"
    exit_code = 1


class ConfigError(UserError, ValueError):
    """A config value that cannot run; the message starts with the key, e.g. `model.num_heads: ...`."""

    prefix = "config error"
    exit_code = 2

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class UsageError(UserError):
    """Bad command-line arguments (exit code 2, as argparse's own)."""

    exit_code = 2


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used for this run; the message names the file and what differs."""


class DiskFull(UserError, OSError):
    """A write that ran out of disk space or quota (exit 1); the message names the path and the bytes it needed."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def disk_full(err: BaseException) -> bool:
    """Whether `err` is a write running out of space or quota: an OSError's errno, or the text a library wraps it in
    (safetensors raises 'I/O error: No space left on device (os error 28)')."""
    if isinstance(err, OSError) and err.errno in NO_SPACE:
        return True
    text = str(err)
    return any(f"os error {code}" in text for code in NO_SPACE) or any(
        os.strerror(code) in text for code in NO_SPACE)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


@contextlib.contextmanager
def writing(path: str, needed: Union[int, Callable[[], int]], cleanup: Optional[Callable[[], None]] = None,
            kept: str = "") -> Iterator[None]:
    """Turn a full disk (or quota) while writing `path` into one DiskFull line: the path, the bytes the write
    needs (`needed`: an estimate, or a function giving what was written when it failed) and what is free;
    `cleanup` removes the partial output first; `kept` says what stays intact (e.g. the earlier checkpoints).
    Any other error propagates unchanged."""
    try:
        yield
    except Exception as err:  # noqa: BLE001  (only a full disk is converted; the rest re-raised as it is)
        if not disk_full(err):
            raise
        size = f"the write needs about {_size(needed)}" if isinstance(needed, int) else \
            f"{_size(needed())} were written when it filled"
        if cleanup is not None:
            cleanup()
        where = os.path.abspath(path)
        while not os.path.exists(where):
            where = os.path.dirname(where)
        free = shutil.disk_usage(where).free
        raise DiskFull(f"{path}: no space left on the device (or over quota): {size} and {_size(free)} are free; "
                       f"{kept + '; ' if kept else ''}free space and run again") from None


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def number(kind: type, low=None, high=None, high_open: bool = False) -> Callable[[str], object]:
    """An argparse `type`: a `kind` (int or float) in [low, high] (or [low, high) with `high_open`), so the parser
    itself refuses one out of range in its one line (`--max-pairs: must be >= 1, got -5`)."""
    def parse(text: str):
        value = kind(text)  # a ValueError: argparse's own "invalid int value"
        if (low is not None and value < low) or (high is not None and (value > high or high_open and value == high)):
            bounds = (f"in [{low}, {high}{')' if high_open else ']'}" if high is not None and low is not None
                      else f">= {low}" if low is not None else f"<= {high}")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors as one `error: ...` line (no usage block): a UsageError naming the program."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}; see {self.prog} --help")


def hydra_message(err: Exception) -> str:
    """Hydra's composition error as one line: an unknown preset lists the available ones."""
    options = getattr(err, "options", None)
    missing = getattr(err, "missing_cfg_file", None)
    if missing and options is not None:
        group, name = os.path.split(missing)
        presets = ", ".join(o for o in options if not o.startswith("base_"))  # base_*: the schemas' own nodes
        return f"{group}={name}: no such preset in conf/{group}/; choose one of {presets}"
    text = str(err).split("Config search path:")[0]
    if err.__cause__ is not None:
        text += "\n" + str(err.__cause__).split("\n")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip().strip("^"))


def _hydra_user_error(err: Exception) -> Optional[str]:
    """The one-line message of an error Hydra raised on the user's behalf, else None: its composition errors
    (unknown preset or key, bad override syntax) and an output directory it cannot create or write."""
    from hydra.errors import HydraException

    if isinstance(err, HydraException):
        return f"config error: {hydra_message(err)}"
    if isinstance(err, OSError) and _raised_in_hydra(err):
        return (f"error: hydra.run.dir: cannot create or write {err.filename} ({err.strerror or err}); set "
                f"hydra.run.dir (hydra.sweep.dir with -m) to a writable directory, e.g. hydra.run.dir=outputs/my_run")
    return None


def user_error_in(err: BaseException) -> Optional[UserError]:
    """`err` if it is a UserError, or the one a library re-raised as its own error (OmegaConf wraps what a resolver
    such as `${tokenizer_of:}` raises), else None."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, UserError):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _raised_in_hydra(err: Exception) -> bool:
    """Whether the deepest frame that is Hydra's or this repository's is Hydra's (not a task's own I/O)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    owners = ["hydra" if str(frame.f_globals.get("__name__", "")).startswith("hydra.")
              else "repo" if frame.f_code.co_filename.startswith(repo + os.sep) else None
              for frame, _ in traceback.walk_tb(err.__traceback__)]
    return [o for o in owners if o][-1:] == ["hydra"]


def entry_point(main: Callable[[Optional[Sequence[str]]], Optional[int]]) -> Callable[..., int]:
    """Wrap a CLI's `main(argv)` into the error contract; the wrapped main returns the exit code.

    Hydra is told to raise its errors (HYDRA_FULL_ERROR) instead of printing its own trimmed traceback, so
    that train.py's composition errors reach this one handler too.
    """

    @functools.wraps(main)
    def run(argv: Optional[Sequence[str]] = None) -> int:
        os.environ["HYDRA_FULL_ERROR"] = "1"
        try:
            code = main(argv)
        except Exception as err:
            said = error_line(err)
            if said is None:
                raise
            print(said[0], file=sys.stderr, flush=True)
            return said[1]
        return code if isinstance(code, int) else 0

    return run


def error_line(err: Exception) -> Optional[Tuple[str, int]]:
    """The one line a user error is printed as, and its exit code; None for a bug (its traceback is the message)."""
    wrapped = user_error_in(err)  # the error itself, or one raised inside e.g. a `${tokenizer_of:...}` resolver
    if wrapped is not None:
        return f"{wrapped.prefix}: {wrapped}", wrapped.exit_code
    line = _hydra_user_error(err)
    return None if line is None else (line, 2)
