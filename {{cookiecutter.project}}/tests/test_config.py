"""The configs tree composes in every combination, and the schemas reject bad input early."""

import itertools

import pytest
from conftest import BASE, PROJECT
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from {{cookiecutter.package}}.engine.config import check_values
from {{cookiecutter.package}}.engine.errors import RunError

PACKAGE = "{{cookiecutter.package}}"

GROUPS = {
    "device": ["cpu", "cuda", "xpu", "auto"],
    "amp": ["off", "bf16", "fp16", "auto"],
    "optimizer": ["adamw", "sgd"],
    "scheduler": ["constant", "cosine"],
}


# Each pair of options of any two groups, in 16 combinations (device x amp whole, the two groups that
# interact, and the optimizer and scheduler pairs across them as a Latin square): the daily loop's.
# The rest of the 96 are for `pytest --all`.
LATER = list(itertools.product(GROUPS["optimizer"], GROUPS["scheduler"]))
PAIRWISE = {
    (device, amp, *LATER[(row + column) % len(LATER)])
    for row, device in enumerate(GROUPS["device"])
    for column, amp in enumerate(GROUPS["amp"])
}


@pytest.mark.parametrize(
    "choice",
    [
        pytest.param(choice, marks=() if choice in PAIRWISE else pytest.mark.slow)
        for choice in itertools.product(*GROUPS.values())
    ],
    ids="-".join,
)
def test_every_group_combination_composes_into_typed_values(make_cfg, choice):
    cfg = make_cfg(*(f"{group}={option}" for group, option in zip(GROUPS, choice, strict=True)))
    assert cfg.device.type == choice[0]
    assert isinstance(cfg.amp.enabled, bool) and cfg.amp.enabled == (choice[1] != "off")
    assert cfg.amp.dtype in ("bfloat16", "float16")
    assert cfg.optimizer._target_ == {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"}[choice[2]]
    assert isinstance(cfg.optimizer.lr, float)
    assert cfg.scheduler._target_.endswith(f".schedulers.{choice[3]}")


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("optimizer=sgd", "optimizer.lr=0.05", "scheduler=cosine", "scheduler.warmup_steps=3", "amp=bf16"),
        ("experiment=char_lm", "+metrics.r2._target_=torchmetrics.R2Score", "++trainer.max_steps=7", "name=a.b"),
        ("amp.enabled=maybe",),
        ("trainer.max_stepz=1",),
    ],
    ids=repr,
)
def test_a_tests_config_is_the_one_hydra_composes_from_the_whole_command_line(make_cfg, tracking_uri, overrides):
    """make_cfg composes the files that a command line's options choose once a pytest process and sets
    its values on a copy (conftest._composed): the config, or the error, Hydra gives for all of it."""
    line = [f"{key}={value}" for key, value in {**BASE, "mlflow.tracking_uri": tracking_uri}.items()]
    line += [*overrides, "checkpoint.dir=/runs/here"]
    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        try:
            hydras = OmegaConf.to_container(compose("config", overrides=line))
        except (ConfigCompositionException, ValidationError) as refused:
            hydras = f"{refused} {refused.__cause__}"
    try:
        ours = OmegaConf.to_container(make_cfg(*overrides, "checkpoint.dir=/runs/here"))
    except (ConfigCompositionException, ValidationError) as refused:
        ours = f"{refused} {refused.__cause__}"
    assert ours == hydras


def test_amp_off_is_the_string_option_not_a_yaml_boolean(make_cfg):
    cfg = make_cfg()
    assert cfg.amp.enabled is False and cfg.amp.dtype == "bfloat16"


def test_amp_auto_takes_the_dtype_that_suits_the_device(make_cfg):
    assert make_cfg("device=cuda", "amp=auto").amp.dtype == "bfloat16"
    assert make_cfg("device=cuda", "amp=auto", "device.amp_dtype=float16").amp.dtype == "float16"


def test_boolean_override_false_is_false(make_cfg):
    assert make_cfg("amp=bf16", "amp.enabled=False").amp.enabled is False


def test_accelerator_configs_pin_memory(make_cfg):
    assert make_cfg("device=cuda").device.pin_memory is True
    assert make_cfg("device=cpu").device.pin_memory is False


@pytest.mark.parametrize(
    "override, message",
    [
        ("amp.enabled=maybe", "is not a valid bool"),
        ("trainer.max_stepz=1", "Could not override 'trainer.max_stepz'"),
        ("optimizer.lrr=1", "Could not override 'optimizer.lrr'"),  # a component's keys too, without +
        ("device=tpu", "Could not find 'device/tpu'"),
        ("trainer.max_steps=many", "could not be converted to Integer"),
    ],
)
def test_bad_values_and_misspelt_keys_fail_at_composition(make_cfg, override, message):
    with pytest.raises((ConfigCompositionException, ValidationError)) as raised:
        make_cfg(override)
    assert message in str(raised.value) + str(raised.value.__cause__)


@pytest.mark.parametrize(
    "override, message",
    [
        ("checkpoint.keep_last=0", "checkpoint.keep_last=0 must be at least 1"),
        ("trainer.max_steps=-1", "trainer.max_steps=-1 must not be negative"),
        (
            "checkpoint.continuity.on_mismatch=ignore",
            "checkpoint.continuity.on_mismatch=ignore must be one of warn, error",
        ),
        ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite=ignore must be one of stop, skip_step, warn"),
        ("optimizer.lr=nan", "optimizer.lr=nan must be a finite number"),
        ("optimizer.lr=inf", "optimizer.lr=inf must be a finite number"),
        ("data.num_workers=-1", "data.num_workers=-1 must not be negative"),
        ("device.cpu_threads=-3", "device.cpu_threads=-3 must not be negative"),
        ("checkpoint.continuity.rtol=-1", "checkpoint.continuity.rtol=-1.0 must not be negative"),
        ("+optimzer=sgd", "optimzer is not a setting (did you mean optimizer?)"),
        ("+trainer.max_step=5", "trainer.max_step is not a setting (did you mean trainer.max_steps?)"),
        ("name=../../../../tmp/x", "name='../../../../tmp/x' must be a plain name"),
        ("name=/tmp/x", "name='/tmp/x' must be a plain name"),
        ("name=a/./b", "name='a/./b' must be a plain name"),
        ("optimized_metric=val/f1", "optimized_metric=val/f1 is not a metric of this run; one of val/loss"),
    ],
)
def test_out_of_range_values_are_named_in_one_line_before_any_work(make_cfg, override, message):
    with pytest.raises(RunError) as raised:
        check_values(make_cfg(override))
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "value, shown", [(v, v) for v in ("0", "-3", "0.0", "1.5", "-0.5", "nan", "abc", "10%")] + [("true", "True")]
)
def test_a_validation_limit_that_is_neither_a_count_of_batches_nor_a_fraction_is_refused_in_one_line(
    make_cfg, value, shown
):
    with pytest.raises(RunError) as raised:
        check_values(make_cfg(f"trainer.limit_val_batches={value}"))
    assert str(raised.value) == (
        f"trainer.limit_val_batches={shown} must be a number of validation batches (an integer, at least 1) or a "
        f"fraction of the validation split (above 0, at most 1.0; 1.0 validates all of it)"
    )


@pytest.mark.parametrize(
    "options",
    [
        ["name=team/ablation-1.2_b", "optimizer=sgd", "scheduler=constant", "amp=fp16"],
        ["model=cnn", "optimized_metric=val/accuracy"],
        ["experiment=cnn_digits"],
        ["experiment=compare_optimizers"],
        ["trainer.limit_val_batches=1"],
        ["trainer.limit_val_batches=0.25"],
    ],
    ids=" ".join,
)
def test_a_nested_name_and_every_shipped_option_pass_the_checks(make_cfg, options):
    check_values(make_cfg(*options))


def test_a_named_experiment_sets_what_its_file_says_over_the_defaults(make_cfg):
    cfg = make_cfg("experiment=cnn_digits")
    assert (cfg.name, cfg.model._target_, cfg.trainer.channels_last) == ("cnn-digits", f"{PACKAGE}.models.CNN", True)
    assert make_cfg("experiment=cnn_digits", "name=mine").name == "mine"  # the command line still wins


def test_an_interpolation_that_names_nothing_is_one_line_naming_the_setting(make_cfg):
    with pytest.raises(RunError) as raised:
        check_values(make_cfg("scheduler.total_steps=${trainer.max_stepz}"))
    assert str(raised.value) == (
        "scheduler.total_steps: Interpolation key 'trainer.max_stepz' not found; fix the interpolation it holds"
    )


@pytest.mark.parametrize("experiment", ["token_gpt", "arrow_digits"])
def test_a_setting_the_configs_leave_for_the_command_line_is_named_in_one_line_when_missing(make_cfg, experiment):
    with pytest.raises(RunError) as raised:
        check_values(make_cfg(f"experiment={experiment}"))
    assert str(raised.value) == "data.dir has no value; give it one: data.dir=<value>"


def test_an_index_on_the_cpu_is_refused_but_auto_may_resolve_to_the_cpu_with_one(make_cfg):
    with pytest.raises(RunError, match="device.index=7 means nothing on device=cpu; leave device.index out"):
        check_values(make_cfg("device=cpu", "device.index=7"))
    check_values(make_cfg("device=auto", "device.index=1"))


def test_the_slurm_preset_extends_submitits_slurm_launcher():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[sweeps]'")
    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        cfg = compose("config", ["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.timeout_min, launcher.gpus_per_node) == (240, 1)
