"""The model: both families (GPT-2, the Llama-style decoder), their layers, the sparse linear
layer over sparse_ops and methods, activation sparsity, the loss. Imports the methods,
sparse_ops and the foundation, never the run (training/), the commands (cli/) or the tools
(perf/). This __init__ imports nothing."""
