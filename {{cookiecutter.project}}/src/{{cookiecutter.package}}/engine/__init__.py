"""The engine: the recipe, checkpoints, tracking, distribution and the rest that the template
maintains (`cruft update` brings its fixes). Nothing here is yours to edit to bring a model, data,
task, metric or callback, and nothing here imports them: they are named by `_target_` in configs/.
What your side may take from here is `data` (`Data`, the type a data component returns, and
`read_file`) and the ready components of `ready/`, which take no more of it than yours may."""
