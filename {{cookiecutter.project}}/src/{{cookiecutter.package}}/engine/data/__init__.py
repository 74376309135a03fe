"""The data: what a `data` component gives the run, and how the run draws from it so that a resumed
run sees exactly the batches an unbroken run would have seen.

- contract.py: `Data`, what a data component returns; `read_file`, how it reads its files;
  `DataError`, a problem with the data said in one line; `SPLIT_SEED`, the seed the ready datasets split by.
- position.py: where the data stands, a checkpoint part.
- order.py: the order of an epoch, a pure function of the seed, never listed whole.
- streams.py: training data that is a stream, read in order over processes and workers.
- loaders.py: the sampler and the loaders, for training and validation.
- workers.py: the loaders' worker processes, which end with the run however it ends, and whose
  refusals reach it as they said them.
- formats/: datasets read from disk and checked against a manifest: token shards, Arrow shards.

What your data components import is here: `from <package>.engine.data import Data, read_file`.
"""

from .contract import SPLIT_SEED, Data, DataError, read_file

__all__ = ["SPLIT_SEED", "Data", "DataError", "read_file"]
