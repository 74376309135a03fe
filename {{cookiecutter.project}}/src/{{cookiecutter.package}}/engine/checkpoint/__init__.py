"""The run's checkpoints, one owner for all of them. The recipe hands its parts to a
`manager.Checkpointer` and calls it: restore, try_save, final; it holds the folder with `claim.claim`,
and, with `checkpoint.remote`, the run's folder in a store (remote/), which it mirrors its saves to.

- manager.py: the Checkpointer: what is saved and restored, when, in which format, and where mirrored.
- claim.py: the run's hold on its folder: the lock, and what a run refused at its start leaves.
- home.py: the run's folder: the checkpoints' names, `latest` and `best`, retention, set-aside.
- onefile.py, sharded.py: the two formats, one file (single, ddp) and a folder of shards (fsdp);
  dcp_files.py: what DCP reads and writes in that folder, made safe.
- schema.py: what a checkpoint of format 3 holds, checked at read, and its typed accessors.
- resume.py: what `resume=` names, found and read.
- initial.py: fine-tuning's start: another run's weights (`init.checkpoint`) loaded, nothing else.
- compatibility.py: whether a checkpoint can continue this run; what a resume changes.
- background.py: the copy and the writer thread of `checkpoint.async_save`.
- remote/: the object-storage side, its own map.

Nothing is imported here: a process that reads one module of the package loads no other.
"""
