"""`python -m <package>.engine.tracking drain|replay`: the sender process, and its replay."""

from .tracker import main

main()
