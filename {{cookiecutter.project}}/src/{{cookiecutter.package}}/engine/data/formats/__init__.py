"""Datasets read from disk, a sample or a window at a time and never whole, each checked against
its folder's manifest before anything trains; the `data` options token_shards and arrow_folder.

- manifest.py: a shard folder's manifest: per shard, its bytes, samples and sha256.
- shards.py: token shards as nanoGPT and Megatron write them; `python -m ... shards write`.
- arrow.py: Arrow shards of Hugging Face `datasets`; `python -m ... arrow describe`.
- save_to_disk.py: the folder layout of `datasets`' `save_to_disk`, which arrow.py reads.
- digits.py: scikit-learn's digits file, read by the ready `digits` and arrow's `write-digits`.
"""
