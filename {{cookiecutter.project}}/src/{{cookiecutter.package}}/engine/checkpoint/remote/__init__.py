"""The run's checkpoints in an object store (`checkpoint.remote`, docs/preemptible-machines.md):
the run's folder there held by one machine at a time, fetched from when a home holds no newer
checkpoint, and mirrored to as the run saves.

- url.py: `checkpoint.remote` as typed: a store's folder or a mounted path, with no credential.
- store.py: the store behind it, every call within a deadline, through fsspec or the file system.
- manifest.py: a remote checkpoint's manifest, written last, which makes the checkpoint visible.
- mirror.py: the run's home uploaded by rank 0 in a thread of its own, newest checkpoint first.
- fetch.py: the newest valid remote checkpoint, fetched into a home that holds none newer.
- claim.py: the run's claim on its remote folder, renewed while it trains; `Lost` once another
  machine took it.
- run_folder.py: what a run does with its remote folder, in order: claim, fetch, mirror, settle.
"""
