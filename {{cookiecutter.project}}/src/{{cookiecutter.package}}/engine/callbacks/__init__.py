"""Callbacks: your code, called by the recipe at its points (docs/callbacks.md).

- hooks.py: the hooks, the run's public side a hook gets, and their calls in the recipe.
- time_limit.py: a hook's time bound (`trainer.hook_timeout_s`), and a stop that interrupts it.
- state.py: what a callback's state may be, to be saved in a checkpoint and read back.
"""
