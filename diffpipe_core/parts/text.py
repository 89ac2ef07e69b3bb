"""Prompt encoding as the diffusers pipelines do it, from parts: tokenize with padding and truncation to a fixed
length, take a hidden layer, drop a prompt template's prefix, mask or zero the padding, and the pooled vector.

A plugin states, per text encoder, one :class:`TextEncoding` (its template, its layer, its length) and calls
:func:`encode_text`; or, where the pipeline's own ``encode_prompt`` needs nothing but its text components, builds
it with :func:`text_pipeline` and calls that. Every cached text tensor has the same length for every caption, as
the cache requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TextEncoding:
    """How one text encoder's output is made.

    Attributes:
        max_length: tokens after the template prefix is dropped; captions are padded/truncated to it.
        template: the prompt template, ``{}`` standing for the caption (e.g. a chat template).
        drop_tokens: tokens of the template before the caption, cut off the output (and the mask).
        hidden_layer: which hidden state (``-1`` the last, ``-2`` the penultimate, ...); None: the encoder's first
            output (``last_hidden_state``).
        use_mask: run the encoder with the attention mask (T5 in Cosmos and Wan; CLIP never).
        zero_padding: zero the embeddings at padding positions (after each caption's tokens).
        pooled: the output attribute holding a pooled vector to return too (``"pooler_output"``, ``"text_embeds"``).
    """

    max_length: int
    template: str = "{}"
    drop_tokens: int = 0
    hidden_layer: int | None = None
    use_mask: bool = False
    zero_padding: bool = False
    pooled: str | None = None


@dataclass
class TextOutput:
    """``embeds`` ``(B, max_length, d)`` float32, ``mask`` ``(B, max_length)`` bool, ``pooled`` ``(B, d)`` or None."""

    embeds: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None


def tokenize(tokenizer: Any, texts: list[str], max_length: int) -> Any:
    """Token ids and attention mask padded and truncated to ``max_length`` (the tokenizer's own special tokens)."""
    return tokenizer(texts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")


@torch.no_grad()
def encode_text(encoder: Any, tokenizer: Any, captions: list[str], spec: TextEncoding) -> TextOutput:
    """One text encoder's cached tensors for ``captions`` as ``spec`` says; on the encoder's device, moved to CPU."""
    device = next(encoder.parameters()).device
    texts = [spec.template.format(c) for c in captions]
    tokens = tokenize(tokenizer, texts, spec.max_length + spec.drop_tokens)
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    kwargs: dict[str, Any] = {"attention_mask": mask} if spec.use_mask else {}
    if spec.hidden_layer is None:
        out = encoder(ids, output_hidden_states=False, **kwargs)
        embeds = out[0]
    else:
        out = encoder(ids, output_hidden_states=True, **kwargs)
        embeds = out.hidden_states[spec.hidden_layer]
    embeds, mask = embeds[:, spec.drop_tokens :].float(), mask[:, spec.drop_tokens :].bool()
    if spec.zero_padding:
        embeds = embeds * mask.unsqueeze(-1)
    pooled = getattr(out, spec.pooled).float().cpu() if spec.pooled else None
    return TextOutput(embeds.cpu(), mask.cpu(), pooled)


def text_pipeline(pipeline_class: str, **components: Any) -> Any:
    """A diffusers pipeline holding only ``components`` (its text encoders and tokenizers; every other component
    None), for calling its own ``encode_prompt``."""
    import inspect

    import diffusers

    cls = getattr(diffusers, pipeline_class)
    names = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    return cls(**{name: components.get(name) for name in names})


def fixed_length(embeds: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad (with zeros, mask False) or truncate ``(B, L, d)`` embeddings and their ``(B, L)`` mask to ``length``."""
    b, n = mask.shape
    if n >= length:
        return embeds[:, :length], mask[:, :length]
    pad = embeds.new_zeros(b, length - n, embeds.shape[-1])
    return torch.cat([embeds, pad], dim=1), torch.cat([mask, mask.new_zeros(b, length - n)], dim=1)
