"""The ready components, one module per kind: models (MLP, CNN, GPT), datasets (digits,
python_source, text_folder), tasks (Supervised, NextToken), metrics (Accuracy, Perplexity),
callbacks (ConfusionMatrix, TextSample) and schedulers (constant, cosine). The template maintains them here, in the engine, so that an
update brings their fixes and never writes your files: yours (`models.py` and the rest, beside
engine/) import them under the names configs/ gives them (`{{cookiecutter.package}}.models.MLP`), and your own
components subclass them or sit beside them."""
