"""What do callbacks cost a training step? `python run.py` with its defaults timed as
bench/step_overhead.py times it (the steps after the first 200, from the times MLflow holds for
the logged losses), with no callback, with one that defines only `on_validation_end` (and does
nothing there), and with one that defines `on_train_step_end` (doing nothing there either). A
callback without a per-step hook costs a step one check of a flag (hooks.py): its ratio to no
callback is 1.00x within the noise of the machine. Each run in a fresh interpreter, alternating,
medians of `--repeats`.

    python bench/hooks_overhead.py [--repeats 3] [--steps 2200]
"""

import argparse
import itertools
import tempfile
from pathlib import Path

from startup import alternating, workspace
from step_overhead import WARM_UP, runner_ms

CALLBACKS = """
class AtValidation:
    def on_validation_end(self, run, metrics):
        pass


class AtStep:
    def on_train_step_end(self, run, loss):
        pass
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2200, help=f"a multiple of 100 above {WARM_UP}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = workspace(Path(folder))
        (work / "bench_callbacks.py").write_text(CALLBACKS)  # beside run.py: importable by its runs
        names = (f"hooks-{number}" for number in itertools.count())  # a fresh run each time

        def timed(*overrides: str) -> float:
            return runner_ms(next(names), args.steps, work, *overrides)

        measured = alternating(
            {
                "no callback": lambda: timed("callbacks=[]"),
                "on_validation_end only": lambda: timed("+callbacks.quiet._target_=bench_callbacks.AtValidation"),
                "on_train_step_end": lambda: timed("+callbacks.quiet._target_=bench_callbacks.AtStep"),
            },
            args.repeats,
        )
    for name, milliseconds in measured.items():
        print(f"{name}: {milliseconds:.3f} ms a step")
    for name in ("on_validation_end only", "on_train_step_end"):
        print(f"{name} / no callback: {measured[name] / measured['no callback']:.3f}x")


if __name__ == "__main__":
    main()
