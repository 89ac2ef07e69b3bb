"""HiDream-I1 samples: the plugin's denoising hooks under the core's loop equal ``HiDreamImagePipeline`` for the same
tiny model, noise, prompt embeddings and steps, with the folder's scheduler (flow-matching Euler at shift 3 as Dev
and Fast ship it; UniPC's flow solver, a multistep one), without and with classifier-free guidance, the decoded image
included."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_hidream.plugin import plugin as hidream
from diffpipe_hidream.testing import tiny_config

PROMPT, STEPS, SEED, SIZE = "a red cat on a tree", 3, 5, 32
UNIPC = {"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": True, "flow_shift": 3.0,
         "prediction_type": "flow_prediction"}


@pytest.fixture(scope="module")
def unipc_folder(tiny_hidream: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny folder with a UniPC flow scheduler (what HiDream's own code samples Full with)."""
    folder = tmp_path_factory.mktemp("unipc") / "model"
    shutil.copytree(tiny_hidream, folder)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(UNIPC))
    index = json.loads((folder / "model_index.json").read_text())  # the class the pipeline loads
    (folder / "model_index.json").write_text(json.dumps({**index, "scheduler": ["diffusers", UNIPC["_class_name"]]}))
    return folder


@pytest.mark.parametrize(("scheduler", "cfg_scale"), [("euler", 1.0), ("euler", 2.0), ("unipc", 2.0)])
def test_hidream_sample_equals_the_pipeline(tiny_hidream: Path, unipc_folder: Path, scheduler: str,
                                            cfg_scale: float) -> None:
    from diffusers import HiDreamImagePipeline

    folder = unipc_folder if scheduler == "unipc" else tiny_hidream
    plugin = registered(hidream, "hidream")
    cfg = tiny_config(folder)
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)

    pipe = HiDreamImagePipeline.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    hidream.sample_pipeline_setup(pipe, request)
    assert type(pipe.scheduler).__name__ == ("UniPCMultistepScheduler" if scheduler == "unipc" else
                                            "FlowMatchEulerDiscreteScheduler")
    noise = torch.randn((1, 4, 4, 4), generator=noise_generator(SEED, 0))
    embeds = {"prompt_embeds_t5": texts.cond["t5_embeds"], "prompt_embeds_llama3": texts.cond["llama_embeds"]
              .transpose(0, 1), "pooled_prompt_embeds": texts.cond["pooled"]}
    if cfg_scale > 1:
        embeds |= {"negative_prompt_embeds_t5": texts.uncond["t5_embeds"],
                   "negative_prompt_embeds_llama3": texts.uncond["llama_embeds"].transpose(0, 1),
                   "negative_pooled_prompt_embeds": texts.uncond["pooled"]}
    expected = pipe(latents=noise, num_inference_steps=STEPS, guidance_scale=cfg_scale, height=SIZE, width=SIZE,
                    output_type="latent", **embeds).images
    assert_same_sample(ours, expected, noise)
    if scheduler == "unipc" or cfg_scale > 1:
        return
    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        vae = pipe.vae
        want = vae.decode(ours / vae.config.scaling_factor + vae.config.shift_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
