"""Tiny word-level tokenizers for tests: built in-process (no hub access) with the ``tokenizers`` library and
wrapped in ``PreTrainedTokenizerFast``, so they save and load back with ``AutoTokenizer`` like the real ones
(transformers' model-specific classes such as ``CLIPTokenizer`` do not load such a folder faithfully). For a
byte-level BPE tokenizer (Qwen, Llama-3), see :func:`diffpipe_core.testing.tiny.bpe_tokenizer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def word_level_tokenizer(
    words: Sequence[str], specials: Sequence[str], template: str, max_length: int, **names: str
) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``specials`` (ids 0.., in order) then the sorted distinct ``words``:
    lowercased, split on whitespace, ``<unk>`` for unknown words, the specials atomic, and ``template`` as the
    post-processor (e.g. ``"<s> $A </s>"`` for CLIP-like, ``"$A </s>"`` for T5-like). ``names`` are the special
    token roles (``pad_token="<pad>"``, ``eos_token="</s>"``, ...); ``specials`` must contain ``<unk>``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(specials)
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(words) - set(specials)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(s, vocab[s]) for s in specials if s in template]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", model_max_length=max_length, **names)
