"""TFDS dataset builders owned by s24jax (see text_corpus.py)."""

from s24jax.datasets.text_corpus import TextCorpus, TextCorpusConfig, text_corpus_builder

__all__ = ['TextCorpus', 'TextCorpusConfig', 'text_corpus_builder']
