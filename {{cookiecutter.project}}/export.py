"""`python export.py name=<run> checkpoint=best|last|<run name or path> out=model.safetensors
dtype=fp32|bf16|fp16`: the checkpoint's model weights as one safetensors file, with a sidecar
(model.json) that says how to build the model they fit: the run's own, from its checkpoint."""

import sys

import hydra

from {{cookiecutter.package}}.engine.checkpoint.remote.url import refuse_typed
from {{cookiecutter.package}}.engine.config import Config  # with the resolvers the configs use
from {{cookiecutter.package}}.engine.config_roots import before_hydra
from {{cookiecutter.package}}.engine.saved_model import take


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: Config):
    from {{cookiecutter.package}}.engine.exporting import main as export

    export(cfg, asked["checkpoint"], asked["out"], asked["dtype"])


if __name__ == "__main__":
    refuse_typed(sys.argv)  # first: Hydra prints an override it cannot parse, a secret with it
    before_hydra(__file__)
    asked = take(sys.argv, checkpoint="best", out="model.safetensors", dtype="fp32")
    main()
