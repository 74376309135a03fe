"""Which MLflow run a leg writes into, in the sender process (sender.py): a new one, or, resuming,
the run its checkpoint names, only where that run is this run (its name, its experiment, this
store); and, at every leg, the settings the run trains with now (`current.<key>` tags). The store
itself, its experiments and what a run records are mlflow_store.py's.
"""

import contextlib
import logging
import re

from mlflow import MlflowClient
from mlflow.entities import Param, Run
from mlflow.exceptions import MlflowException

from ..config import MlflowConfig
from ..errors import RunError, first_line, shown
from .mlflow_store import connect, deleted_experiment, experiment_id, in_batches, log_datasets, set_tags

log = logging.getLogger(__name__)

# The settings a run trains with now, one tag per param: params keep the first leg's values.
CURRENT = "current."
REPLACED = "resumed_from_run"  # tags a run opened in place of the one a checkpoint named
RUN_ID = re.compile(r"[\w-]+")  # a run id that a search's filter can quote as it is


def current(params: dict[str, str]) -> dict[str, str]:
    return {f"{CURRENT}{key}": value for key, value in params.items()}


class RunOpener:
    """Opens the job's run: a new one, with the flattened config as params and the resolved config
    as an artifact; or, resuming, the run that wrote the checkpoint, so its curves stay one line in
    the UI. Params are immutable in MLflow: what changed since the run began goes into tags named
    `resume.<n>.<key>`, and every setting the run trains with now into `current.<key>`, at each leg.
    A checkpoint whose run is not this run's gets a new run (_continued), tagged with the checkpoint."""

    def __init__(self, client: MlflowClient, cfg: MlflowConfig) -> None:
        self.client, self.cfg = client, cfg
        self.parent_tags = {"mlflow.parentRunId": cfg.parent_run_id} if cfg.parent_run_id else {}
        self.run_id: str | None = None
        self.resumes = 0

    def create(self, params: dict[str, str], tags: dict[str, str], config_yaml: str, started: int | None) -> None:
        """A new run, started at `started` (ms since the epoch): when the training process set it up,
        not when this process got to it, which may be seconds later (MLflow's Duration)."""
        experiment = self._parents_experiment() or experiment_id(self.client, self.cfg)
        tags = {**tags, **self.parent_tags}
        run = self.client.create_run(experiment, start_time=started, run_name=self.cfg.run_name, tags=tags)
        self.run_id = run.info.run_id
        self._log_params(params)
        set_tags(self.client, self.run_id, current(params))
        self.client.log_text(self.run_id, config_yaml, "config.yaml")

    def continue_(
        self,
        run_id: str | None,
        params: dict[str, str],
        tags: dict[str, str],
        config_yaml: str,
        checkpoint: str,
        started: int | None,
    ) -> None:
        run = self._continued(run_id, params["name"], checkpoint)
        if run is None:
            replaced = {REPLACED: run_id} if run_id else {}
            self.create(params, {**tags, "resumed_from_checkpoint": checkpoint, **replaced}, config_yaml, started)
            return
        self.run_id = run_id = run.info.run_id
        self.client.update_run(run_id, status="RUNNING")
        self.resumes = int(run.data.tags.get("resumes", "0")) + 1
        resumes, old = self.resumes, run.data.params
        # Params keep their first values; what a resume changed, set or made null is tagged.
        changed = {f"resume.{resumes}.{key}": value for key, value in params.items() if old.get(key) != value}
        changed.update({f"resume.{resumes}.{key}": "None" for key in old.keys() - params.keys() if old[key] != "None"})
        self._log_params({key: value for key, value in params.items() if key not in old})
        resume_tags = {"resumes": str(resumes), f"resume.{resumes}.checkpoint": checkpoint}
        now = current(params)
        set_tags(self.client, run_id, {**tags, **self.parent_tags, **changed, **resume_tags, **now})
        for key in run.data.tags.keys() - now.keys():
            if key.startswith(CURRENT):  # a setting this leg leaves null: no param would show it either
                self.client.delete_tag(run_id, key)

    def _continued(self, run_id: str | None, name: str, checkpoint: str) -> Run | None:
        """The run to continue: `run_id`, which `checkpoint` names, where it is this run's (in this
        store, not deleted, of this `name` and experiment), or the one an earlier leg opened in its
        place. Else None, after a line that says why: a run id in a checkpoint is data from anywhere
        (one copied into another name's home), and chooses no run but this run's."""
        try:
            run = self.client.get_run(run_id) if run_id else None
        except MlflowException:
            run = None
        level = logging.INFO
        if run is not None and run.info.lifecycle_stage == "active":
            if (whose := self._whose_run(run, name)) is None:
                return run
            level = logging.WARNING
            why = (
                f"{checkpoint} names MLflow run {run_id}, {whose}, not this run ({shown(name)!r} in "
                f"{self.cfg.experiment_name!r}); that run is left as it is, and this one continues in a run of its own"
            )
        elif run is not None:
            experiment = self.client.get_experiment(run.info.experiment_id)
            gone = experiment.lifecycle_stage == "deleted"  # with its runs
            if gone and experiment.name == self.cfg.experiment_name:  # where the new run would go
                raise RunError(deleted_experiment(experiment, self.cfg.tracking_uri, f", and run {run_id} with it"))
            restore = (
                f"experiments restore --experiment-id {experiment.experiment_id}"
                if gone
                else f"runs restore --run-id {run_id}"
            )
            why = (
                f"MLflow run {run_id} is deleted; continuing in a new run (`MLFLOW_TRACKING_URI="
                f"{self.cfg.tracking_uri} mlflow {restore}` brings the old one back)"
            )
        elif run_id is not None:
            why = f"MLflow run {run_id} is not in {self.cfg.tracking_uri}; continuing in a new run"
        else:
            why = "the checkpoint was written untracked; continuing in a new MLflow run"
        if (instead := self._opened_instead(run_id, name)) is not None:  # said when it was opened
            return instead
        log.log(level, why)
        return None

    def _whose_run(self, run: Run, name: str) -> str | None:
        """None where `run` is this run: of this `name` (its param), in the project's experiment, or
        in one this run's earlier legs may have opened it in: the older grouping's, named after the
        run, or the parent's (a sweep job's). Otherwise whose run it is, in words."""
        experiment = self.client.get_experiment(run.info.experiment_id).name
        ran_as = run.data.params.get("name", experiment)  # before `name`, the older grouping named the experiment
        if ran_as == name and (
            experiment in (self.cfg.experiment_name, name) or run.info.experiment_id == self._parents_experiment()
        ):
            return None
        return f"the run {shown(ran_as)!r} in experiment {shown(experiment)!r}"

    def _opened_instead(self, run_id: str | None, name: str) -> Run | None:
        """The newest run of this run's that an earlier leg opened in place of `run_id` (tagged
        `resumed_from_run`): that leg's saves held `run_id` until its sender answered, at once for a
        leg that ended first (tracker.Tracker.state_dict), and its checkpoint names `run_id` still."""
        if run_id is None or not RUN_ID.fullmatch(run_id):
            return None
        experiment = self._parents_experiment() or experiment_id(self.client, self.cfg)
        found = self.client.search_runs(
            [experiment], f"tags.{REPLACED} = '{run_id}'", order_by=["attributes.start_time DESC"]
        )
        return next((run for run in found if self._whose_run(run, name) is None), None)

    def _parents_experiment(self) -> str | None:
        """The experiment of the run this one nests under (a sweep's, or the run an evaluation
        judges): MLflow shows a child under its parent only within one experiment, and a parent
        started under another grouping (one experiment per `name`, before) stays where it is."""
        try:
            parent = self.client.get_run(self.cfg.parent_run_id) if self.cfg.parent_run_id else None
        except MlflowException:  # not in this store: the run goes where the config says
            return None
        return parent.info.experiment_id if parent is not None and parent.info.lifecycle_stage == "active" else None

    def _log_params(self, params: dict[str, str]) -> None:
        in_batches(self.client, self.run_id, params=[Param(key, value) for key, value in params.items()])


def open_run(cfg: MlflowConfig, asked: dict) -> RunOpener | None:
    """The run `asked` describes (tracker.Tracker.open), opened; None, after a one-line warning,
    when the store fails: training does not depend on it. A run opened and then failed is ended
    FAILED, not left RUNNING."""
    opener = None
    try:
        opener = RunOpener(connect(cfg.tracking_uri), cfg)
        described = asked["params"], asked["tags"], asked["config_yaml"]
        if asked["checkpoint"] is None:
            opener.create(*described, asked["started"])
        else:
            opener.continue_(asked["run_id"], *described, asked["checkpoint"], asked["started"])
        try:
            log_datasets(opener.client, opener.run_id, asked["datasets"])
        except Exception as error:  # the run is open: it goes on, without its Dataset column
            log.warning(f"MLflow did not take the run's datasets ({first_line(error)})")
        return opener
    except Exception as error:
        log.warning(f"MLflow at {cfg.tracking_uri} failed ({first_line(error)}); training goes on without tracking")
        if opener is not None and opener.run_id is not None:
            with contextlib.suppress(Exception):  # the store is failing already; said above
                opener.client.set_terminated(opener.run_id, status="FAILED")
        return None


def attach_run(cfg: MlflowConfig, run_id: str, name: str) -> RunOpener | None:
    """The run `run_id` as it is, for a resume of `name` with nothing left to train: not marked
    RUNNING, no resume counted, nothing tagged; only the models it lacks are logged to it
    (logged_models.py). None, after a one-line warning, when the store fails or does not have it,
    or it is not this run's (a checkpoint copied from another run's home)."""
    try:
        opener = RunOpener(connect(cfg.tracking_uri), cfg)
        whose = opener._whose_run(opener.client.get_run(run_id), name)
    except Exception as error:
        log.warning(
            f"MLflow at {cfg.tracking_uri} cannot give run {run_id} ({first_line(error)}); its models are not logged"
        )
        return None
    if whose is not None:
        log.warning(
            f"the checkpoint names MLflow run {run_id}, {whose}, not this run ({shown(name)!r}): that run is left as "
            f"it is, and no model is logged to it"
        )
        return None
    opener.run_id = run_id
    return opener
