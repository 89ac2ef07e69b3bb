"""The SDXL UNet as a list of pipeline layers: embed (conv_in + time/added-condition embedding), one layer per
resnet of every down, mid and up block (with the transformer that follows it and the block's down/upsampler),
and the output head. SDXL: 1 + 6 + 2 + 9 + 1 = 19 layers; with the text encoders trained, their layer first.

Every layer takes and returns one tuple ``(h, [emb], [text, text_mask], *skips)``: the hidden state, the
time embedding (until the last up block), the text embeddings and their mask (until the last block with
cross-attention), then the skip activations the up blocks will consume (pushed by the down blocks, popped
by the up blocks, as in ``UNet2DConditionModel.forward``). A tensor is dropped from the tuple after its
last user, so every float that crosses a stage boundary is used downstream.
"""

from __future__ import annotations

import torch
from torch import nn

Tensors = tuple[torch.Tensor, ...]
Optional = torch.Tensor | None
Module = nn.Module | None


class _Layer(nn.Module):
    def __init__(self, takes_emb: bool, takes_text: bool, gives_emb: bool, gives_text: bool) -> None:
        super().__init__()
        self.takes_emb, self.takes_text, self.gives_emb, self.gives_text = takes_emb, takes_text, gives_emb, gives_text

    def unpack(self, inputs: Tensors) -> tuple[torch.Tensor, Optional, Optional, Optional, list[torch.Tensor]]:
        h, rest = inputs[0], list(inputs[1:])
        emb = rest.pop(0) if self.takes_emb else None
        text, mask = (rest.pop(0), rest.pop(0)) if self.takes_text else (None, None)
        return h, emb, text, mask, rest

    def pack(self, h: torch.Tensor, emb: Optional, text: Optional, mask: Optional, skips: list) -> Tensors:
        return (h, *([emb] if self.gives_emb else []), *([text, mask] if self.gives_text else []), *skips)


class EmbedLayer(_Layer):
    """``(x_t, t, text, text_mask, pooled, time_ids)`` -> ``(conv_in(x_t), emb, text, mask, conv_in(x_t))``."""

    def __init__(self, unet: nn.Module, gives_text: bool) -> None:
        super().__init__(False, False, True, gives_text)
        self.conv_in, self.time_proj, self.time_embedding = unet.conv_in, unet.time_proj, unet.time_embedding
        self.add_time_proj, self.add_embedding = unet.add_time_proj, unet.add_embedding

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, mask, pooled, time_ids = inputs
        dtype = self.conv_in.weight.dtype
        h = self.conv_in(x.to(dtype))
        emb = self.time_embedding(self.time_proj(t).to(dtype))
        time_embeds = self.add_time_proj(time_ids.flatten()).reshape(pooled.shape[0], -1)
        emb = emb + self.add_embedding(torch.cat([pooled, time_embeds], dim=-1).to(dtype))
        return self.pack(h, emb, text.to(dtype), mask, [h])


class UnitLayer(_Layer):
    """One resnet of a UNet block with the transformer that follows it (if any) and the block's down/upsampler
    (on its last unit), exactly as the diffusers blocks chain them:

    - ``down``: resnet, attention, push the result as a skip; the downsampler's output is pushed too;
    - ``up``: pop a skip and concatenate it, resnet, attention; the upsampler takes the size of the next skip;
    - ``mid``: (attention, then) resnet: the mid block's first unit is its first resnet alone.
    """

    def __init__(self, kind: str, resnet: nn.Module, attention: Module, sampler: Module, *flags: bool) -> None:
        """``flags``: takes text, gives text, gives the time embedding."""
        super().__init__(True, flags[0], flags[2], flags[1])
        self.kind, self.resnet, self.attention, self.sampler = kind, resnet, attention, sampler

    def _attend(self, h: torch.Tensor, text: Optional, mask: Optional) -> torch.Tensor:
        if self.attention is None:
            return h
        assert text is not None and mask is not None
        bias = ((1 - mask.to(h.dtype)) * -10000.0).unsqueeze(1)  # the UNet's encoder_attention_mask bias
        return self.attention(h, encoder_hidden_states=text, encoder_attention_mask=bias, return_dict=False)[0]

    def forward(self, inputs: Tensors) -> Tensors:
        h, emb, text, mask, skips = self.unpack(inputs)
        if self.kind == "mid":
            h = self.resnet(self._attend(h, text, mask), emb)
        elif self.kind == "down":
            h = self._attend(self.resnet(h, emb), text, mask)
            skips.append(h)
            if self.sampler is not None:
                h = self.sampler(h)
                skips.append(h)
        else:
            h = self._attend(self.resnet(torch.cat([h, skips.pop()], dim=1), emb), text, mask)
            if self.sampler is not None:
                h = self.sampler(h, skips[-1].shape[2:] if skips else None)
        return self.pack(h, emb, text, mask, skips)


class TextLayer(nn.Module):
    """With the text encoders trained: ``(x_t, t, ids, chunks, ids_2, chunks_2, time_ids)`` -> ``(x_t, t, text,
    text_mask, pooled, time_ids)``, both encoders run as caching runs them (``encoding.conditioning``)."""

    def __init__(self, text_encoder: nn.Module, text_encoder_2: nn.Module) -> None:
        super().__init__()
        self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2

    def forward(self, inputs: Tensors) -> Tensors:
        from diffpipe_sdxl.encoding import conditioning

        x, t, ids, chunks, ids_2, chunks_2, time_ids = inputs
        text, mask, pooled = conditioning((self.text_encoder, self.text_encoder_2), (ids, ids_2), (chunks, chunks_2))
        return x, t, text, mask, pooled, time_ids


class OutLayer(nn.Module):
    """``(h,)`` -> ``(prediction,)`` in float32: conv_norm_out, SiLU, conv_out."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.conv_norm_out, self.conv_act, self.conv_out = unet.conv_norm_out, unet.conv_act, unet.conv_out

    def forward(self, inputs: Tensors) -> Tensors:
        (h,) = inputs
        return (self.conv_out(self.conv_act(self.conv_norm_out(h))).float(),)


# UNetMidBlock2D (a mid block of one resnet, no attention) and no mid block at all are SDXL-family variants:
# Segmind Vega and SSD-1B, which ComfyUI and diffusers load as SDXL.
SUPPORTED_BLOCKS = ("DownBlock2D", "CrossAttnDownBlock2D", "UNetMidBlock2DCrossAttn", "UNetMidBlock2D", "UpBlock2D")
SUPPORTED_BLOCKS += ("CrossAttnUpBlock2D",)


def check_supported(unet: nn.Module) -> None:
    """The layers replicate ``UNet2DConditionModel.forward`` and its blocks for SDXL-style configs only."""
    cfg, problems = unet.config, []
    if cfg.addition_embed_type != "text_time":
        problems.append(f"addition_embed_type={cfg.addition_embed_type!r} (need 'text_time')")
    for key in ("class_embed_type", "encoder_hid_dim_type", "time_embedding_act_fn"):
        if getattr(cfg, key, None) is not None:
            problems.append(f"{key}={getattr(cfg, key)!r} (need None)")
    if unet.conv_norm_out is None:
        problems.append("no conv_norm_out")
    for block in [*unet.down_blocks, *([unet.mid_block] if unet.mid_block is not None else []), *unet.up_blocks]:
        name = type(block).__name__
        if name == "UNetMidBlock2D" and any(a is not None for a in block.attentions):
            problems.append("UNetMidBlock2D with self-attention (diffusers' UNet2DConditionModel builds it without)")
        if name not in SUPPORTED_BLOCKS:
            problems.append(f"block type {name} (supported: {', '.join(sorted(SUPPORTED_BLOCKS))})")
        if getattr(block, "s1", None) is not None:
            problems.append("FreeU is enabled")
    if problems:
        raise ValueError(f"UNet config not supported by the SDXL plugin: {'; '.join(problems)}")


def _units(unet: nn.Module) -> list[tuple[str, nn.Module, nn.Module | None, nn.Module | None]]:
    """``(kind, resnet, attention, sampler)`` in execution order."""
    units = []
    for kind, blocks in (("down", unet.down_blocks), ("up", unet.up_blocks)):
        if kind == "up" and unet.mid_block is not None:
            mid = unet.mid_block
            units.append(("mid", mid.resnets[0], None, None))
            units += [("mid", r, a, None) for a, r in zip(mid.attentions, mid.resnets[1:])]
        for block in blocks:
            attentions = list(getattr(block, "attentions", None) or [None] * len(block.resnets))
            samplers = block.downsamplers if kind == "down" else block.upsamplers
            for j, (resnet, attention) in enumerate(zip(block.resnets, attentions)):
                last = j == len(block.resnets) - 1
                units.append((kind, resnet, attention, samplers[0] if last and samplers is not None else None))
    return units


def split_unet(unet: nn.Module) -> list[nn.Module]:
    """The pipeline layers of an SDXL UNet (see the module docstring); first the text encoders' layer when the UNet
    holds them (``text_encoder``, ``text_encoder_2``: they train with it)."""
    check_supported(unet)
    units = _units(unet)
    last = max((i for i, u in enumerate(units) if u[2] is not None), default=-1)  # the last unit with text
    text = [TextLayer(unet.text_encoder, unet.text_encoder_2)] if hasattr(unet, "text_encoder_2") else []
    layers: list[nn.Module] = [*text, EmbedLayer(unet, gives_text=last >= 0)]
    layers += [UnitLayer(*u, i <= last, i < last, i < len(units) - 1) for i, u in enumerate(units)]
    return [*layers, OutLayer(unet)]
