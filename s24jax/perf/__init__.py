"""The planning and GPU-performance tools: the planner (compiles the real step for a GPU
without one), each sparse GEMM's plan, the compiled step's census, roofline and step-time
model, the GPU report, the compression's memory traffic. They import the library; nothing in
the library imports them (tests/test_imports.py). This __init__ imports nothing."""
