"""`python eval.py name=<run> checkpoint=best|last|<run name or path> [overrides]`: the checkpoint's
model judged on the validation (and test) split, logged to an MLflow run nested under the run that
trained it. The model and the data are the run's own, from its checkpoint; overrides change how they
are judged (data.batch_size=..., device=...)."""

import atexit
import gc
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from {{cookiecutter.package}}.engine import tracking
from {{cookiecutter.package}}.engine.checkpoint.remote.url import refuse_typed
from {{cookiecutter.package}}.engine.config import Config  # with the resolvers the configs use
from {{cookiecutter.package}}.engine.config_roots import before_hydra


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: Config):
    from {{cookiecutter.package}}.engine.evaluating import main as evaluate  # after the sender starts (run.py says why)

    sys.argv[:] = typed  # Hydra has read the rest: a message that repeats the command repeats it whole
    evaluate(cfg, asked["checkpoint"], Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    refuse_typed(sys.argv)  # first: Hydra prints an override it cannot parse, a secret with it
    before_hydra(__file__)
    typed = list(sys.argv)
    tracking.start_sender()
    from {{cookiecutter.package}}.engine.saved_model import take  # imports torch: after the sender starts

    asked = take(sys.argv, checkpoint="best")
    atexit.register(gc.freeze)  # as run.py does, and for the same reason
    main()
