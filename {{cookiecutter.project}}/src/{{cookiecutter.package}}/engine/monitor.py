"""What `optimized_metric` says of a run as it trains: its value at each save, which ranks the
checkpoints (`checkpoint.keep_best`), and, read at each scheduled validation, its best value so
far by `optimized_mode` and early stopping (`trainer.early_stopping`): the run stops once the
metric has not improved by more than `min_delta` for `patience` validations in a row.

Its state is a checkpoint part, so a resume neither forgets the best value nor gives the patience
back: a run stopped early and resumed with the same settings trains no further, and a run stopped
by a signal stops early at the step the unbroken run would have. A validation that a stop cut short
is owed: the resumed run does it first, as the unbroken run did it at that step.
"""

import logging
import math

from .config import Config

log = logging.getLogger(__name__)


class Monitor:
    def __init__(self, cfg: Config) -> None:
        self.metric, self.mode, self.max_steps = cfg.optimized_metric, cfg.optimized_mode, cfg.trainer.max_steps
        self.patience = cfg.trainer.early_stopping.patience
        self.min_delta = cfg.trainer.early_stopping.min_delta
        self.best: float | None = None  # at the last improvement by more than min_delta
        self.best_step: int | None = None
        self.waited = 0  # validations since that improvement
        # The latest validation: its step, and its metrics with the step's training loss.
        self.latest: tuple[int, dict[str, float]] | None = None
        # A validation a stop cut short: its step, and that step's training loss (None before a first step).
        self.owed: tuple[int, float | None] | None = None

    def validated(self, step: int, metrics: dict[str, float]) -> None:
        self.latest, self.owed = (step, metrics), None

    def abandoned(self, step: int, loss: float | None) -> None:
        """A stop cut short the validation of `step`."""
        self.owed = (step, loss)

    def score_at(self, step: int) -> dict | None:
        """What ranks the checkpoint of `step`: the metric validated at that step (None if it was not)."""
        if self.latest is None or self.latest[0] != step or self.metric not in self.latest[1]:
            return None
        return {"metric": self.metric, "mode": self.mode, "value": self.latest[1][self.metric]}

    def observe(self) -> None:
        """Judges the latest validation, a scheduled one (a value that is not finite never improves)."""
        step, metrics = self.latest
        value = metrics[self.metric]
        if math.isfinite(value) and (self.best is None or self._beats(value, self.best)):
            self.best, self.best_step, self.waited = value, step, 0
        else:
            self.waited += 1

    def _beats(self, value: float, best: float) -> bool:
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta

    @property
    def stopped(self) -> bool:
        """Whether early stopping has run out of patience (under this run's settings: a resume with
        more patience, or without early stopping, trains on)."""
        return self.patience is not None and self.waited >= self.patience

    def ended(self, step: int) -> bool:
        """Whether the run has trained all it will at `step`: trainer.max_steps, or stopped early."""
        return step >= self.max_steps or self.stopped

    def finished(self, step: int) -> bool:
        """Whether the run is done at `step`: ended, and owing no validation that a stop cut short."""
        return self.ended(step) and self.owed is None

    def explain(self) -> str:
        best = "no finite value yet" if self.best is None else f"best {self.best:.4g} at step {self.best_step}"
        return f"{self.metric} has not improved by more than {self.min_delta:g} for {self.waited} validations ({best})"

    def state_dict(self) -> dict:
        return {
            "metric": self.metric,
            "mode": self.mode,
            "best": self.best,
            "best_step": self.best_step,
            "waited": self.waited,
            "owed": list(self.owed) if self.owed is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state.get("waited"), int):
            raise ValueError(f"a count of validations is an integer; found {state.get('waited')!r}")
        if not _finite(state.get("best")):
            raise ValueError("its best value is not a finite number a float can hold")
        owed = state.get("owed")  # a checkpoint written before validations could be cut short owes none
        if owed is not None and not (
            isinstance(owed, list)
            and len(owed) == 2
            and type(owed[0]) is int
            and (owed[1] is None or type(owed[1]) is float)
        ):
            raise ValueError(f"a validation owed is a step and its training loss; found {owed!r}")
        self.owed = tuple(owed) if owed is not None else None
        if (state.get("metric"), state.get("mode")) != (self.metric, self.mode):
            log.info(
                f"the checkpoint watched {state.get('metric')} ({state.get('mode')}), this run watches {self.metric} "
                f"({self.mode}): its best value and patience start afresh"
            )
            return
        self.best, self.best_step, self.waited = state["best"], state["best_step"], state["waited"]


def _finite(best: object) -> bool:
    """Whether `best` can be a metric's best value: an integer too large for a float (a crafted
    checkpoint) would raise OverflowError at the first comparison."""
    try:
        return best is None or (isinstance(best, int | float) and not isinstance(best, bool) and math.isfinite(best))
    except OverflowError:
        return False
