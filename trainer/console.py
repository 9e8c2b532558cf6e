"""Console progress: a tqdm bar with loss, the objective's own numbers, lr, tokens/s and MFU, and one line per
evaluation with the objective's (its `console` names: objectives/__init__.py)."""
import contextlib
import io
import sys
from typing import Iterator, Sequence

from tqdm import tqdm

from trainer.callbacks import Callback


class ConsoleProgress(Callback):
    """A sink (log, close) and the callback that moves the bar one step."""

    def __init__(self, max_steps: int, start_step: int = 0, enabled: bool = True, keys: Sequence[str] = (),
                 bar: bool = True):
        """`enabled`: this process prints (the main rank); `bar`: with the progress bar (logger.progress_bar), else
        the evaluations' lines alone; `keys`: the objective's console names (e.g. DPO's rewards/accuracies)."""
        self.enabled, self.keys = enabled, tuple(keys)
        self.bar = tqdm(total=max_steps, initial=start_step, disable=not (enabled and bar), dynamic_ncols=True,
                        unit="step", mininterval=1.0)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        if "val_loss" in metrics:
            line = evaluation_line(metrics, self.keys)
            self.bar.write(line) if not self.bar.disable else print(line, flush=True)
            return
        if self.bar.disable:
            return
        own = {k.rsplit("/", 1)[-1]: f"{metrics[k]:.4g}" for k in self.keys if k in metrics}
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", **own, lr=f"{metrics['lr']:.2e}",
                             tok_s=f"{metrics['tokens_per_sec']:.0f}", mfu=f"{metrics['mfu']:.2%}", refresh=False)

    def on_step(self, step: int, result) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def evaluation_line(metrics: dict, keys: Sequence[str]) -> str:
    """`step N: val_loss L` then, where the loss is a per-token NLL (val_bpb is there), its perplexity and bits per
    byte, then the objective's own val_<key>s."""
    parts = [f"step {metrics['step']}: val_loss {metrics['val_loss']:.4f}"]
    if "val_bpb" in metrics:
        parts += [f"val_ppl {metrics['val_ppl']:.2f}", f"val_bpb {metrics['val_bpb']:.4f}"]
    parts += [f"val_{k} {metrics[f'val_{k}']:.4f}" for k in keys if f"val_{k}" in metrics]
    return " ".join(parts)


class _Tee(io.TextIOBase):
    """Writes through to `stream` and, line by line, to `log`: of a line redrawn in place (a progress bar's \r
    updates) only its last state."""

    def __init__(self, stream, log):
        self.stream, self.log, self.line = stream, log, ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.line += text
        if "\n" in self.line:
            *done, self.line = self.line.split("\n")
            self.log.write("".join(part.rsplit("\r", 1)[-1] + "\n" for part in done))
            self.log.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


@contextlib.contextmanager
def console_to(path: str) -> Iterator[None]:
    """What this process prints (stdout and stderr: the config, the progress bar's final states, evaluations,
    errors) goes to `path` too: a run directory's train.log."""
    with open(path, "a", encoding="utf-8") as log:
        saved = sys.stdout, sys.stderr
        tees = sys.stdout, sys.stderr = _Tee(saved[0], log), _Tee(saved[1], log)
        try:
            yield
        finally:
            for tee in tees:  # (not sys.stdout/stderr: a library may have replaced them meanwhile)
                if tee.line:
                    log.write(tee.line.rsplit("\r", 1)[-1] + "\n")
            sys.stdout, sys.stderr = saved
