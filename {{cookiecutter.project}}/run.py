"""`python run.py [group=option ...] [key=value ...]`: see configs/config.yaml for the groups."""

import hydra
from omegaconf import DictConfig

from {{cookiecutter.package}}.train import main as train


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig):
    return train(cfg)  # in a sweep, the job's value (its final val/loss) goes to the sweeper


if __name__ == "__main__":
    main()
