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


def compacted(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid tokens (``mask``) moved to the front in order, the rest zeros (mask False): text a pipeline
    pads in the middle (Krea 2's ``[caption | padding | closing turn]``) or on the left (Ideogram 4) as ``[tokens |
    padding]``, for a model whose text takes no position from its padding."""
    out, kept = torch.zeros_like(embeds), torch.zeros_like(mask)
    for row in range(mask.shape[0]):
        n = int(mask[row].sum())
        out[row, :n], kept[row, :n] = embeds[row][mask[row]], True
    return out, kept


def trimmed(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached :func:`compacted` text cut to the longest caption among ``mask``'s rows (at least one token; the rest is
    masked padding anyway); the mask as bool."""
    n = max(1, int(mask.sum(dim=1).max()))
    return embeds[:, :n], mask[:, :n].bool()


#: CLIP's context: BOS, 75 tokens, EOS
CLIP_CHUNK = 77


def chunk_token_ids(
    tokenizer: Any, captions: list[str], max_chunks: int, chunk: int = CLIP_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Long prompts as A1111 and kohya encode them for CLIP: token ids ``(B, max_chunks, chunk)`` and a chunk mask
    ``(B, max_chunks)`` (bool).

    Each caption's tokens are cut into pieces of ``chunk - 2``, each wrapped as ``BOS tokens EOS pad...``, at most
    ``max_chunks`` (longer prompts are truncated). A caption that fits in one piece gives exactly diffusers'
    ``padding="max_length", max_length=chunk`` ids in its first chunk. Unused chunks hold ``BOS EOS pad...`` and are
    masked out.
    """
    body = chunk - 2
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    tokens = tokenizer(captions, add_special_tokens=False, truncation=False)["input_ids"]
    ids = torch.full((len(captions), max_chunks, chunk), pad, dtype=torch.long)
    ids[:, :, 0] = bos
    mask = torch.zeros(len(captions), max_chunks, dtype=torch.bool)
    for b, seq in enumerate(tokens):
        seq = list(seq)[: body * max_chunks]
        n_chunks = max(1, -(-len(seq) // body))
        for c in range(max_chunks):
            piece = seq[c * body : (c + 1) * body] if c < n_chunks else []
            ids[b, c, 1 : 1 + len(piece)] = torch.tensor(piece, dtype=torch.long)
            ids[b, c, 1 + len(piece)] = eos
        mask[b, :n_chunks] = True
    return ids, mask


def encode_chunks(
    encoder: Any, ids: torch.Tensor, chunk_mask: torch.Tensor, hidden_layer: int = -2, pooled: str | None = None
) -> TextOutput:
    """Run ``encoder`` on the valid chunks of :func:`chunk_token_ids`' output, on the encoder's device, with autograd
    (wrap in ``torch.no_grad()`` while caching): ``embeds`` ``(B, k * chunk, d)`` float32, hidden layer
    ``hidden_layer`` of each chunk side by side (zeros for unused chunks); ``mask`` ``(B, k * chunk)``, whole chunks;
    ``pooled``: the output attribute ``pooled`` (``"text_embeds"``) of each caption's first chunk."""
    n, k, chunk = ids.shape
    device = next(encoder.parameters()).device
    valid = chunk_mask.reshape(-1).to(device)
    out = encoder(ids.reshape(-1, chunk).to(device)[valid], output_hidden_states=True)
    states = out.hidden_states[hidden_layer].float()
    full = torch.zeros(n * k, chunk, states.shape[-1], dtype=torch.float32, device=states.device)
    full[valid.to(states.device)] = states
    first = None
    if pooled is not None:  # chunk 0 is always valid: caption b's is row `valid chunks before b`
        counts = chunk_mask.sum(1)
        first = getattr(out, pooled).float()[(counts.cumsum(0) - counts).to(states.device)]
    mask = chunk_mask.to(device).repeat_interleave(chunk, dim=1)
    return TextOutput(full.reshape(n, k * chunk, -1), mask, first)
