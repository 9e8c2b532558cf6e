"""The error contract of every entry point: a user error is one line, a bug keeps its traceback.

A user error is something the user can fix — a config value, a missing/unreadable/corrupt file, the wrong
kind of checkpoint, a missing credential, a layout this machine cannot run. It is raised as a `UserError`
(ConfigError, UsageError here; data.DataError, checkpoint.CheckpointError, data.tasks.TaskError,
trainer.guard.TrainingStopped) whose message names the key or file and the fix. Each CLI's `main(argv)` is
wrapped in `entry_point`, which prints such an error as `error: <what>, <where>; <how to fix>` (`config
error: ...` for config values) and returns its exit code — 2 for what was typed (a value, a path, an
argument), 1 for a file or the environment; anything else is a bug and propagates with its traceback.
Shared by base/validate.py, the plug-ins' own checks and every CLI; tests/test_errors.py is the table.
"""
import argparse
import functools
import os
import sys
import traceback
from typing import Callable, Optional, Sequence


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


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


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
        except UserError as err:
            print(f"{err.prefix}: {err}", file=sys.stderr, flush=True)
            return err.exit_code
        except Exception as err:
            line = _hydra_user_error(err)
            if line is None:
                raise
            print(line, file=sys.stderr, flush=True)
            return 2
        return code if isinstance(code, int) else 0

    return run
