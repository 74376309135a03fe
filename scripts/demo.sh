#!/usr/bin/env bash
# Bake the default template, train 200 steps on CPU, resume to 400, evaluate the best checkpoint,
# sweep two optimizers, and say where MLflow logged it all. Expects the template venv's python,
# pip and cookiecutter first on PATH (`make demo`).
set -euo pipefail
cd "$(dirname "$0")/.."

# demo/my-trainer is this script's own output; removing it means the first leg starts from
# step 0 instead of silently finding an old checkpoint.
rm -rf demo/my-trainer
cookiecutter --no-input --overwrite-if-exists -o demo .
# The venv already has setuptools and every dependency, so no isolated build env is needed.
python -m pip install -q --no-deps --no-build-isolation -e demo/my-trainer

cd demo/my-trainer
# The first leg stops halfway through a 400-step schedule, as a preempted job would.
python run.py device=cpu trainer.max_steps=200 scheduler.total_steps=400 mlflow.log_models=best
python run.py device=cpu trainer.max_steps=400 resume=last mlflow.log_models=best
# The best checkpoint judged in a run nested under the demo's; then AdamW against SGD, a sweep.
python eval.py device=cpu checkpoint=best
python run.py -m experiment=compare_optimizers device=cpu trainer.max_steps=200

cat <<'MSG'

All of it is logged to MLflow. To look at it:
  cd demo/my-trainer && ../../.venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db
then open http://127.0.0.1:5000/#/experiments?workflowType=machine_learning
(or click "Model training" at the top left: MLflow 3 opens in its GenAI view)
MSG
