"""Anima cut into pipeline layers: the LLM adapter (diffusers' ``AnimaTextConditioner``) and Cosmos-Predict2's
embedding in the first layer, then Predict2's blocks and final layer (:mod:`diffpipe_cosmos.layers`).

Into the first layer: ``(x (B, C, 1, H, W), t (B,), qwen (B, L, d), qwen_mask (B, L), t5_ids (B, T), t5_mask (B, T))``:
the noisy latents as one frame, the time in [0, 1] (the pipeline's ``timestep / num_train_timesteps``), Qwen3's last
hidden states (zero past each caption) and the T5 token ids the adapter embeds, with their masks. The adapter maps them
to the transformer's text (padded with zeros to its ``min_sequence_length``), as ``AnimaTextConditioningStep`` does;
the rest is :class:`diffpipe_cosmos.layers.EmbedLayer` on it, without a frame rate (the pipeline gives none).
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_cosmos import layers

Tensors = tuple[torch.Tensor, ...]


class AnimaEmbedLayer(nn.Module):
    """The LLM adapter over the cached text, then the transformer's embedding (patches, RoPE, time)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.text_conditioner = model.text_conditioner
        self.embed = layers.EmbedLayer(model, None)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, qwen, qwen_mask, t5_ids, t5_mask = inputs
        dtype = self.text_conditioner.out_proj.weight.dtype
        # no gradient to the cached text (the pipeline engine makes the first stage's float inputs require one):
        # a frozen adapter then builds no graph at all, a trained one only its own
        text = self.text_conditioner(
            source_hidden_states=qwen.detach().to(dtype),
            target_input_ids=t5_ids.long(),
            target_attention_mask=t5_mask,
            source_attention_mask=qwen_mask,
        )
        return self.embed((x, t, text))


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a ``CosmosTransformer3DModel`` holding its ``text_conditioner``."""
    cosmos = layers.split_into_layers(model, None)
    return [AnimaEmbedLayer(model), *cosmos[1:]]
