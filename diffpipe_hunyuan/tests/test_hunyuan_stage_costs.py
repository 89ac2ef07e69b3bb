"""Issue 28: the stage plan's activation measurement runs through every HunyuanVideo layer on the meta device (the
final layer un-patches with sizes read from an integer tensor) and keeps what a real forward keeps."""

from __future__ import annotations

import torch

from diffpipe_core import TrainingContext
from diffpipe_core.schema import validate
from diffpipe_core.testing.activations import check_meta_activations
from diffpipe_hunyuan.config import HunyuanConfig
from diffpipe_hunyuan.layers import split_into_layers
from diffpipe_hunyuan.plugin import plugin as hy
from diffpipe_hunyuan.testing import TinyHunyuanConfig, tiny_transformer


def test_meta_activations_match_a_real_forward(tiny_hunyuan, crop_start: int) -> None:
    cfg = validate(HunyuanConfig, {"type": "hunyuan-video", "path": tiny_hunyuan, "text_crop_start": crop_start}, "t")
    model = tiny_transformer(TinyHunyuanConfig())
    gen = torch.Generator().manual_seed(0)
    batch = {  # what encode_batch caches: 5-frame latents at 64x64, 8 text tokens (2 of them padding)
        "latents": torch.randn(2, 4, 2, 8, 8, generator=gen),
        "text_embeds": torch.randn(2, 8, 32, generator=gen),
        "text_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2]),
        "clip_pooled": torch.randn(2, 32, generator=gen),
    }
    inputs, _ = hy.prepare_inputs(batch=batch, context=TrainingContext(model_config=cfg), generator=gen)
    pairs = check_meta_activations(model, split_into_layers(model), inputs, hy.lora_targets(model_config=cfg))
    assert len(pairs) == 6 and all(real > 0 for real, _ in pairs[1:])
