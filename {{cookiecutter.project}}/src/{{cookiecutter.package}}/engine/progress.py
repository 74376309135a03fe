"""What a person watching a run sees of its progress, and the throughput it logs: a bar on a terminal; off one (under SLURM,
nohup, CI), where a bar shows nothing, a line at a logging step once `trainer.progress_every_s`
seconds have passed since the last, so that a log file shows the run is alive and when it ends.
Only rank 0 shows either."""

import logging
import time
from datetime import timedelta

import torch
from tqdm import tqdm

from .config import TrainerConfig

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, trainer: TrainerConfig, step: int, main: bool) -> None:
        self.bar = tqdm(total=trainer.max_steps, initial=step, disable=None if main else True, desc="train")
        self.lines = main and self.bar.disable  # tqdm disables itself when stdout is not a terminal
        self.every_s, self.max_steps = trainer.progress_every_s, trainer.max_steps
        self.first_step, self.started = step, time.monotonic()
        self.last_line = self.started

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bar.close()

    def step(self) -> None:
        self.bar.update()

    def report(self, step: int, loss: float, rate: float, unit: str) -> None:
        self.bar.set_postfix({"loss": f"{loss:.4f}", f"{unit}_s": f"{rate:.0f}"})
        now = time.monotonic()
        if not self.lines or now - self.last_line < self.every_s:
            return
        self.last_line = now
        steps_per_s = (step - self.first_step) / max(now - self.started, 1e-9)
        eta = timedelta(seconds=round((self.max_steps - step) / steps_per_s)) if steps_per_s else "?"
        log.info(f"step {step}/{self.max_steps}: loss {loss:.4f}, {rate:.0f} {unit}/s, ETA {eta}")


class Throughput:
    """Steps, and the task's units (samples, tokens), per second: over the window since the last
    log (`train/samples_per_s`, logged at each logging step), and over the whole run
    (`train/mean_samples_per_s`, at its end and in the sweep table). A count may be a tensor on the
    device (tokens that are not padding): it is read only when a rate is."""

    def __init__(self, unit: str) -> None:
        self.unit, self.rate, self.mean = unit, f"train/{unit}_per_s", f"train/mean_{unit}_per_s"
        self.started = self.window_started = time.perf_counter()
        self.steps = self.units = self.window_steps = self.window_units = 0

    def count(self, units: int | torch.Tensor) -> None:
        self.steps, self.units = self.steps + 1, self.units + units
        self.window_steps, self.window_units = self.window_steps + 1, self.window_units + units

    def window(self) -> dict[str, float]:
        """The window's rates, and a new window."""
        now = time.perf_counter()
        seconds = now - self.window_started
        rates = {
            self.rate: float(self.window_units) / seconds,
            "train/step_time_ms": 1000 * seconds / self.window_steps,
        }
        self.window_started, self.window_steps, self.window_units = now, 0, 0
        return rates

    def total(self) -> dict[str, float]:
        seconds = time.perf_counter() - self.started
        return {"train/mean_steps_per_s": self.steps / seconds, self.mean: float(self.units) / seconds}
