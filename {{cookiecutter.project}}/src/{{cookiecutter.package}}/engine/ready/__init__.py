"""The ready components, one module per kind: models (MLP, CNN, GPT), datasets (digits,
python_source, text_folder), datasets read from disk and checked against a manifest (manifest.py:
token shards in shards.py; Arrow shards of Hugging Face `datasets` in arrow.py, their folder's
layout in save_to_disk.py), tasks (Supervised, NextToken), metrics (Accuracy, Perplexity),
callbacks (ConfusionMatrix, TextSample) and schedulers (constant, cosine). The template maintains them here, in the engine, so that an
update brings their fixes and never writes your files: yours (`models.py` and the rest, beside
engine/) import them under the names configs/ gives them (`{{cookiecutter.package}}.models.MLP`), and your own
components subclass them or sit beside them."""
