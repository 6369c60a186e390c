"""The run: the config, the checks before anything is written, the train step and the
optimizer, the loop and its chores, checkpoints, preemption, the workdir, sharding, FLOP
accounting, a finished run read back. Imports the model (nn/), the methods, sparse_ops, the
data and the foundation; never the commands (cli/) or the tools (perf/). This __init__ imports
nothing."""
