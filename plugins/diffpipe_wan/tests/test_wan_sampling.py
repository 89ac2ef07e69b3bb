"""Samples (issue 22): the plugin's denoising hooks under the core's loop equal ``WanPipeline`` and
``WanImageToVideoPipeline`` for the same tiny model, noise, prompt embeddings, steps and guidance (the folder's own
scheduler), and the decoded video equals ``WanPipeline``'s (image-to-video decodes the same way); an image-to-video
sample starts from ``[model] sample_image``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import validate
from diffpipe_core.testing.media import write_png
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_wan.i2v import wan_i2v
from diffpipe_wan.plugin import wan

PROMPT, STEPS, SEED, FRAMES, W, H = "a red cat walks", 3, 5, 5, 48, 32
CPU = torch.device("cpu")


def sample(plugin, cfg, cfg_scale: float) -> tuple[torch.Tensor, object]:
    """The core's loop over the plugin's layers: the final latents and the prompt's text tensors."""
    handle = registered(plugin)
    (texts,) = encode_prompts(handle, cfg, [PROMPT], "blurry", CPU)
    request = SampleRequest(width=W, height=H, frames=FRAMES, steps=STEPS)
    return sample_latents(handle, cfg, request, texts, SEED, cfg_scale), texts, handle


def noise() -> torch.Tensor:
    return torch.randn((1, 4, 2, H // 8, W // 8), generator=noise_generator(SEED, 0))


def pipeline_latents(pipe, texts, cfg_scale: float, **kwargs) -> torch.Tensor:
    """The pipeline's final latents from the same noise and prompt embeddings, with classifier-free guidance as the
    core's loop does it (the negative prompt's embeddings, the same scale)."""
    return pipe(
        prompt_embeds=texts.cond["text_embeds"],
        negative_prompt_embeds=texts.uncond["text_embeds"],
        guidance_scale=cfg_scale,
        latents=noise(),
        num_inference_steps=STEPS,
        height=H,
        width=W,
        num_frames=FRAMES,
        output_type="latent",
        **kwargs,
    ).frames


def assert_decodes_like_the_pipeline(registered, cfg, latents: torch.Tensor, pipe) -> None:
    ((_, pixels),) = decode(registered, cfg, {0: latents}, CPU)
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        want = vae.decode(latents / inv_std + mean).sample[0].clamp(-1, 1)  # WanPipeline's decoding
    assert pixels.shape == (3, FRAMES, H, W)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)


def with_unipc(folder: Path, into: Path) -> Path:
    """A copy of ``folder`` whose scheduler is the released Wan 2.1 folders' ``UniPCMultistepScheduler`` (flow
    sigmas, ``flow_shift`` 5): a multistep solver, so Euler on its sigmas would not sample what the pipeline does."""
    import shutil

    from diffusers import UniPCMultistepScheduler

    shutil.copytree(folder, into)
    shutil.rmtree(into / "scheduler")
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    unipc.save_config(into / "scheduler")
    index = json.loads((into / "model_index.json").read_text())
    (into / "model_index.json").write_text(json.dumps({**index, "scheduler": ["diffusers", "UniPCMultistepScheduler"]}))
    return into


@pytest.mark.parametrize("scheduler", ["flow-match Euler", "UniPC"])
def test_wan_sample_equals_wan_pipeline(tiny_wan: Path, tmp_path: Path, scheduler: str) -> None:
    from diffusers import WanPipeline

    folder = tiny_wan if scheduler == "flow-match Euler" else with_unipc(tiny_wan, tmp_path / "unipc")
    table = {"type": "wan", "path": folder, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    cfg = validate(wan.spec.config_schema, table, "test")
    ours, texts, registered = sample(wan, cfg, 3.0)
    pipe = WanPipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    assert type(pipe.scheduler).__name__ == ("UniPCMultistepScheduler" if scheduler == "UniPC" else
                                             "FlowMatchEulerDiscreteScheduler")  # fmt: skip
    assert_same_sample(ours, pipeline_latents(pipe, texts, 3.0), noise())
    if scheduler == "flow-match Euler":
        assert_decodes_like_the_pipeline(registered, cfg, ours, pipe)


@pytest.mark.parametrize("scheduler", ["flow-match Euler", "UniPC"])
def test_wan_i2v_sample_equals_wan_image_to_video_pipeline(tiny_wan_i2v: Path, tmp_path: Path, scheduler: str) -> None:
    from diffusers import WanImageToVideoPipeline

    folder = tiny_wan_i2v if scheduler == "flow-match Euler" else with_unipc(tiny_wan_i2v, tmp_path / "unipc")
    image_file = write_png(tmp_path / "first.png", 60, 40, seed=4)  # resized to 48x32 as the pipeline resizes
    table = {"type": "wan-i2v", "path": folder, "dtype": "float32", "encoder_dtype": "float32"}
    cfg = validate(wan_i2v.spec.config_schema, {**table, "sample_image": image_file}, "test")
    ours, texts, _ = sample(wan_i2v, cfg, 2.0)
    pipe = WanImageToVideoPipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    expected = pipeline_latents(pipe, texts, 2.0, image=Image.open(image_file).convert("RGB"))
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)  # (decoding: as wan's, the test above)

    without = validate(wan_i2v.spec.config_schema, table, "test")
    with pytest.raises(ValueError, match="wan-i2v samples are generated from a first frame: set"):
        wan_i2v.denoise_init(SampleRequest(width=W, height=H, frames=FRAMES), without, noise_generator(SEED, 0))
