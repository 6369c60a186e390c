"""s24jax: 2:4 sparse pre-training of transformers in JAX/Flax."""

__version__ = "0.1.0"
