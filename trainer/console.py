"""Console progress: a tqdm bar with loss, lr, tokens/s and MFU, and one line per evaluation."""
from tqdm import tqdm


class ConsoleProgress:
    def __init__(self, max_steps: int, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.bar = tqdm(total=max_steps, initial=start_step, disable=not enabled, dynamic_ncols=True,
                        unit="step", mininterval=1.0)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        if "val_loss" in metrics:
            self.bar.write(f"step {metrics['step']}: val_loss {metrics['val_loss']:.4f} "
                           f"val_ppl {metrics['val_ppl']:.2f}")
            return
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                             tok_s=f"{metrics['tokens_per_sec']:.0f}", mfu=f"{metrics['mfu']:.2%}", refresh=False)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def close(self) -> None:
        self.bar.close()
