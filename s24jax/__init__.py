"""s24jax: 2:4 sparse pre-training of transformers in JAX/Flax."""

from s24jax.kernels import aot as _aot

__version__ = "0.3.0"

# With the optional CUDA compile plugin installed (requirements-gpu-aot.txt) on a machine
# without an NVIDIA driver, jax would try the CUDA backend first and print a long failed
# version check; pick the CPU up front there (nothing changes on GPU machines, or when
# JAX_PLATFORMS is set).
_aot.cpu_unless_gpu()
