"""A team's own choices over every group's defaults, written where docs/configuration.md puts them:
a setting every option of a group takes in config.yaml, one that a single option takes in a file of
that option's path, which replaces the engine's. A bake's suite passes with them: its tests hold the
engine to its contracts, never to a value the user is meant to change."""

from pathlib import Path

import yaml

OWN_SETTINGS = {
    "name": "ours",
    "seed": 7,
    "trainer": {"max_steps": 120, "log_every_n_steps": 5, "val_every_n_steps": 40},
    "optimizer": {"lr": 6e-4, "weight_decay": 0.05},
    "scheduler": {"warmup_steps": 7},
    "data": {"batch_size": 32},
    "checkpoint": {"every_n_steps": 40, "keep_last": 2},
    "mlflow": {"experiment_name": "ours"},
}
OWN_OPTIONS = {
    Path("model", "mlp.yaml"): {"hidden_sizes": [48], "dropout": 0.2},
    Path("model", "cnn.yaml"): {"channels": [8, 16], "dropout": 0.3},
    Path("scheduler", "cosine.yaml"): {"min_lr_ratio": 0.2},
    Path("data", "digits.yaml"): {"val_fraction": 0.25},  # not every data option splits by a fraction
}


def choose_own_defaults(project: Path) -> None:
    """Write OWN_SETTINGS and OWN_OPTIONS into the bake `project`'s configs/."""
    configs = project / "configs"
    (engine,) = project.glob("src/*/engine/configs")
    with (configs / "config.yaml").open("a", encoding="utf-8") as file:
        file.write("\n" + yaml.safe_dump(OWN_SETTINGS, sort_keys=False))
    for path, changed in OWN_OPTIONS.items():
        option = yaml.safe_load((engine / path).read_text(encoding="utf-8"))
        assert changed.keys() <= option.keys(), f"{path} has no {set(changed) - set(option)}"
        (configs / path).parent.mkdir(exist_ok=True)
        (configs / path).write_text(yaml.safe_dump({**option, **changed}), encoding="utf-8")
