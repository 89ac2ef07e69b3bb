"""LTX-2 cut into pipeline layers: embedders, each audio-video transformer block, output.

What flows between layers (a tuple of tensors; every float tensor is used downstream):

- into the first layer: ``(x, t, audio_x, video_text, audio_text, text_mask, grid)`` (see
  :mod:`diffpipe_ltx.ltx2`): packed video latents ``(B, F*H*W, C)``, each latent frame's flow time ``(B, F)``,
  packed audio latents ``(B, L, C_a*M)``, the connectors' video and audio text ``(B, S, d)``, their mask ``(B, S)``
  and the latent ``(F, H, W)``;
- between blocks: ``(video, audio, video_text, audio_text, temb, audio_temb, ca_scale_shift, ca_audio_scale_shift,
  ca_gate, ca_audio_gate, rope cos/sin for video, audio, video cross, audio cross, text_mask, embedded,
  audio_embedded)``, and with LTX-2.3's prompt adaLN (``prompt_adaln``) two more: ``(temb_prompt,
  temb_prompt_audio)``, the text keys' and values' modulation by the sample's time;
- the last block passes on ``(video, audio, embedded, audio_embedded)``;
- out of the output layer: ``(prediction,)`` in float32: the video prediction ``(B, F*H*W, C)`` and the audio
  prediction ``(B, L, C_a*M)``, flattened and side by side ``(B, F*H*W*C + L*C_a*M)`` (the loss weighs the audio
  part 0 unless ``train_audio``; sampling steps both).

The layers wrap the model's own submodules and call them exactly as ``LTX2VideoTransformer3DModel.forward`` does
when ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline`` call it (``fps`` the frame rate, ``use_cross_timestep=True``:
the audio-video cross-attention modulations take the sample's time, ``sigma = timestep``), so a pipeline of these
layers computes the diffusers model. The video time embedding is computed once per latent frame and spread over that
frame's tokens; when every frame of every sample has the same time it stays one row per sample, as in
``LTX2Pipeline``. The audio stream's time is the sample's (the last frame's: a conditioned first frame is 0).

LTX-2.3 / 2.5 transformers (``cross_attn_mod``, ``use_prompt_embeddings = false``) run through the same layers: there
is no caption projection (the connectors' text already has each stream's width), the blocks' 9-row tables and
prompt tables are the blocks' own, and the prompt adaLN, when the model has one (LTX-2.3; LTX-2.5 has static tables
only), is computed once in the embedders and passed on.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock
from diffpipe_ltx.layers import frame_time_embedding

Tensors = tuple[torch.Tensor, ...]


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((1 - mask.to(dtype)) * -10000.0).unsqueeze(1)  # as the model's forward makes it


class EmbedLayer(nn.Module):
    """Input projections, rotary embeddings, time embeddings and modulations, caption projections."""

    NAMES = ("proj_in", "audio_proj_in", "time_embed", "audio_time_embed", "av_cross_attn_video_scale_shift",
             "av_cross_attn_video_a2v_gate", "av_cross_attn_audio_scale_shift", "av_cross_attn_audio_v2a_gate",
             "rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")
    #: absent from LTX-2.3 / 2.5 (caption projections) or from LTX-2.0 and 2.5 (prompt adaLN)
    OPTIONAL = ("caption_projection", "audio_caption_projection", "prompt_adaln", "audio_prompt_adaln")

    def __init__(self, model: nn.Module, fps: float) -> None:
        super().__init__()
        for name in self.NAMES:
            setattr(self, name, getattr(model, name))
        for name in self.OPTIONAL:
            setattr(self, name, getattr(model, name, None))
        self.fps = fps
        self.gate_factor = model.config.cross_attn_timestep_scale_multiplier / model.config.timestep_scale_multiplier

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, audio_x, text, audio_text, text_mask, grid = inputs
        frames, height, width = (int(v) for v in grid.tolist())
        b, device = x.shape[0], x.device
        video_coords = self.rope.prepare_video_coords(b, frames, height, width, device, fps=self.fps)
        audio_coords = self.audio_rope.prepare_audio_coords(b, audio_x.shape[1], device)
        v_cos, v_sin = self.rope(video_coords, device=device)
        a_cos, a_sin = self.audio_rope(audio_coords, device=device)
        cv_cos, cv_sin = self.cross_attn_rope(video_coords[:, 0:1, :], device=device)
        ca_cos, ca_sin = self.cross_attn_audio_rope(audio_coords[:, 0:1, :], device=device)

        hidden = self.proj_in(x.to(self.proj_in.weight.dtype))
        audio = self.audio_proj_in(audio_x.to(self.audio_proj_in.weight.dtype))
        dtype, audio_dtype = hidden.dtype, audio.dtype
        temb, embedded = frame_time_embedding(self.time_embed, t, height * width, dtype)
        sigma = t[:, -1] * 1000  # the sample's time: the audio stream's and the cross modulations'
        audio_temb, audio_embedded = self.audio_time_embed(sigma, batch_size=b, hidden_dtype=audio_dtype)
        audio_temb, audio_embedded = audio_temb.view(b, 1, -1), audio_embedded.view(b, 1, -1)

        ca_ss, _ = self.av_cross_attn_video_scale_shift(sigma, batch_size=b, hidden_dtype=dtype)
        ca_gate, _ = self.av_cross_attn_video_a2v_gate(sigma * self.gate_factor, batch_size=b, hidden_dtype=dtype)
        ca_audio_ss, _ = self.av_cross_attn_audio_scale_shift(sigma, batch_size=b, hidden_dtype=audio_dtype)
        ca_audio_gate, _ = self.av_cross_attn_audio_v2a_gate(
            sigma * self.gate_factor, batch_size=b, hidden_dtype=audio_dtype
        )
        ca_ss, ca_gate = ca_ss.view(b, 1, -1), ca_gate.view(b, 1, -1)
        ca_audio_ss, ca_audio_gate = ca_audio_ss.view(b, 1, -1), ca_audio_gate.view(b, 1, -1)

        if self.caption_projection is not None:  # LTX-2.0; LTX-2.3's connectors project per stream
            text = self.caption_projection(text.to(dtype)).view(b, -1, hidden.shape[-1])
            audio_text = self.audio_caption_projection(audio_text.to(audio_dtype)).view(b, -1, audio.shape[-1])
        else:
            text, audio_text = text.to(dtype), audio_text.to(audio_dtype)
        out = (hidden, audio, text, audio_text, temb, audio_temb, ca_ss, ca_audio_ss, ca_gate, ca_audio_gate,
               v_cos, v_sin, a_cos, a_sin, cv_cos, cv_sin, ca_cos, ca_sin, text_mask, embedded, audio_embedded)
        if self.prompt_adaln is None:
            return out
        prompt, _ = self.prompt_adaln(sigma, batch_size=b, hidden_dtype=dtype)
        audio_prompt, _ = self.audio_prompt_adaln(sigma, batch_size=b, hidden_dtype=audio_dtype)
        return (*out, prompt.view(b, 1, -1), audio_prompt.view(b, 1, -1))


BETWEEN = 21  # the tensors every LTX-2 block takes (the prompt adaLN's two follow them)


class BlockLayer(WrappedBlock):
    def forward(self, inputs: Tensors) -> Tensors:
        (hidden, audio, text, audio_text, temb, audio_temb, ca_ss, ca_audio_ss, ca_gate, ca_audio_gate,
         v_cos, v_sin, a_cos, a_sin, cv_cos, cv_sin, ca_cos, ca_sin, text_mask, embedded,
         audio_embedded) = inputs[:BETWEEN]
        prompt, audio_prompt = inputs[BETWEEN:] or (None, None)  # LTX-2.3's prompt adaLN, when the model has it
        new_hidden, new_audio = self.block(
            hidden_states=hidden,
            audio_hidden_states=audio,
            encoder_hidden_states=text,
            audio_encoder_hidden_states=audio_text,
            temb=temb,
            temb_audio=audio_temb,
            temb_ca_scale_shift=ca_ss,
            temb_ca_audio_scale_shift=ca_audio_ss,
            temb_ca_gate=ca_gate,
            temb_ca_audio_gate=ca_audio_gate,
            temb_prompt=prompt,
            temb_prompt_audio=audio_prompt,
            video_rotary_emb=(v_cos, v_sin),
            audio_rotary_emb=(a_cos, a_sin),
            ca_video_rotary_emb=(cv_cos, cv_sin),
            ca_audio_rotary_emb=(ca_cos, ca_sin),
            encoder_attention_mask=_bias(text_mask, hidden.dtype),
            audio_encoder_attention_mask=_bias(text_mask, audio.dtype),
        )
        if self.last:
            return new_hidden, new_audio, embedded, audio_embedded
        return (new_hidden, new_audio, *inputs[2:])


class OutputLayer(OutputHead):
    """Final norms modulated by the model's scale-shift tables and embedded timesteps, then the output projections;
    the video and audio predictions flattened side by side."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.audio_norm_out, self.audio_proj_out = model.audio_norm_out, model.audio_proj_out
        self.scale_shift_table = model.scale_shift_table  # the model's own Parameters, shared
        self.audio_scale_shift_table = model.audio_scale_shift_table

    @staticmethod
    def _out(hidden, embedded, table, norm, proj) -> torch.Tensor:
        values = table[None, None] + embedded[:, :, None]
        shift, scale = values[:, :, 0], values[:, :, 1]
        return proj(norm(hidden) * (1 + scale) + shift).float()

    def forward(self, inputs: Tensors) -> Tensors:
        hidden, audio, embedded, audio_embedded = inputs
        video = self._out(hidden, embedded, self.scale_shift_table, self.norm_out, self.proj_out)
        sound = self._out(audio, audio_embedded, self.audio_scale_shift_table, self.audio_norm_out,
                          self.audio_proj_out)
        return (torch.cat([video.flatten(1), sound.flatten(1)], dim=1),)


def split_into_layers(model: nn.Module, fps: float) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``LTX2VideoTransformer3DModel`` (sharing its parameters)."""
    blocks = list(model.transformer_blocks)
    if not blocks:
        raise ValueError("an LTX-2 transformer without transformer_blocks cannot be split into layers")
    return [EmbedLayer(model, fps), *(BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
            OutputLayer(model)]


def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """Packed video ``(B, T, C)`` and audio ``(B, L, D)`` tokens side by side, flat: the output layer's layout."""
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


def per_item_mean(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (B, ...) scaled so that each item's weights sum to 1 (an item weighing nothing stays 0): a weighted
    sum with them is each item's weighted mean."""
    total = weight.flatten(1).sum(1).clamp_min(1e-12)
    return weight / total.view(-1, *([1] * (weight.dim() - 1)))


def split(flat: torch.Tensor, video_tokens: int, video_channels: int, audio_tokens: int) -> Tensors:
    """Inverse of :func:`join`: ``(video (B, T, C), audio (B, L, D))``."""
    b, n = flat.shape[0], video_tokens * video_channels
    return flat[:, :n].reshape(b, video_tokens, video_channels), flat[:, n:].reshape(b, audio_tokens, -1)
