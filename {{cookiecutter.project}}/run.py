"""`python run.py [group=option ...] [key=value ...]`: see configs/config.yaml for the groups."""

import time

began = time.time() - time.process_time()  # first: when this interpreter started (engine/lifecycle/goodput.py says why)

# ruff: noqa: E402
import atexit
import gc
import sys

import hydra

from {{cookiecutter.package}}.engine import tracking
from {{cookiecutter.package}}.engine.checkpoint.remote.url import refuse_typed
from {{cookiecutter.package}}.engine.config import Config  # with the resolvers the configs use
from {{cookiecutter.package}}.engine.config_roots import before_hydra
from {{cookiecutter.package}}.engine.lifecycle import goodput, standby


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: Config):
    # Imported here, not above: torch and the rest take seconds, which the MLflow sender (started
    # below, before them) spends importing MLflow in its own process. A standby leg imports them
    # at the lowest priority, leaving the cores to the leg that trains now.
    if cfg.standby:
        standby.warm_up()
    from {{cookiecutter.package}}.engine.train import main as train

    return train(cfg)  # in a sweep, the job's value (its final val/loss) goes to the sweeper


if __name__ == "__main__":
    goodput.interpreter_started(began)
    refuse_typed(sys.argv)  # first: Hydra prints an override it cannot parse, a secret with it
    before_hydra(__file__)
    tracking.start_sender()
    # The last thing at exit: whatever is alive then lives to the end, so the interpreter's shutdown
    # need not search torch's million objects for garbage (1.2 s, a tenth of a short run).
    atexit.register(gc.freeze)
    main()
