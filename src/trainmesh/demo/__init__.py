"""``trainmesh demo``: a character-level GPT trained on the Python standard library's sources.

The pieces, one concept per module:

* :mod:`~trainmesh.demo.corpus`: the text (read offline from this interpreter's stdlib), the
  character vocabulary, the train/held-out split and the ``(input, target)`` window dataset.
* :mod:`~trainmesh.demo.char_gpt`: the model (a small pre-LN decoder-only transformer) and its loss.
* :mod:`~trainmesh.demo.generate`: seeded temperature / top-k sampling from a trained model.
* :mod:`~trainmesh.demo.job`: the per-process training program that ``trainmesh demo`` launches.

Only the job imports the Trainer, so the parts can be used (and tested) on their own.
"""

from .char_gpt import CharGPT, GPTConfig, lm_loss
from .corpus import CharVocab, CharWindows, Corpus, build_corpus
from .generate import generate

__all__ = ["CharGPT", "CharVocab", "CharWindows", "Corpus", "GPTConfig", "build_corpus", "generate", "lm_loss"]
