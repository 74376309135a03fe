"""Where the data stands in a run, a checkpoint part: the epoch, the samples trained on over all
processes, the order they are drawn in (order.py, streams.py) and a stream's layout, so that a
resume, with any number of processes, continues the same order."""

from dataclasses import dataclass, field

from .order import LISTED, SHUFFLED
from .streams import LANES, STREAM


@dataclass
class Position:
    """Where the data stands: `sample` samples of epoch `epoch` have been trained on, over all
    processes, so that a resume with another number of processes continues the same order; the
    `order` the samples are drawn in (order.py, streams.py), and for a stream the `layout` it is
    read in (its lanes; or the processes and workers that read one without lanes). A checkpoint
    part (state_dict, load_state_dict): a few integers and a name."""

    epoch: int = 0
    sample: int = 0
    order: str = SHUFFLED
    layout: dict[str, int] = field(default_factory=dict)

    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self.epoch, "sample": self.sample, "order": self.order, **self.layout}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        # A checkpoint written before the orders were named was drawn in the one there was then.
        drawn = state.get("order", LISTED)
        if drawn not in LAYOUTS:
            raise ValueError(f"a data position's order is one of {', '.join(LAYOUTS)}; found {drawn!r}")
        counts = {key: value for key, value in state.items() if key != "order"}
        if set(counts) != {"epoch", "sample", *LAYOUTS[drawn]} or any(
            type(value) is not int or value < 0 for value in counts.values()
        ):
            raise ValueError(
                f"a data position is {', '.join(['epoch', 'sample', *LAYOUTS[drawn]])}, counts; found {state}"
            )
        self.epoch, self.sample, self.order = state["epoch"], state["sample"], drawn
        self.layout = {key: counts[key] for key in LAYOUTS[drawn]}


# What each order's position holds beyond the epoch and the sample.
LAYOUTS = {SHUFFLED: (), LISTED: (), LANES: ("lanes",), STREAM: ("processes", "workers")}
