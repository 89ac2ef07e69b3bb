"""LoRA target names that several diffusers model families share (a plugin lists its own after them)."""

from __future__ import annotations

#: the image-side and text-side projections of diffusers' joint (MMDiT) attention blocks (``attn.add_*`` and
#: ``attn.to_add_out`` are the text stream's): Flux, HunyuanVideo, Qwen-Image
JOINT_ATTENTION = (
    *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"),
    *("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"),
)
