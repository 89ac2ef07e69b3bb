"""Wan VACE (``wan-vace``, issue 41): the conditioning equals ``WanVACEPipeline``'s (``prepare_video_latents``,
``prepare_masks``, reference images), the layers chained equal ``WanVACETransformer3DModel.forward`` (the VACE
blocks' hints carried to the blocks that add them), the plugin passes the core's conformance kit, and samples equal
the pipeline's for the same noise, prompt and control video (with and without a mask)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.schema import validate
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.media import write_video
from diffpipe_core.testing.sampling import registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_wan import vace_encoding
from diffpipe_wan.testing import VACE_LAYERS
from diffpipe_wan.vace import read_clip, wan_vace
from diffpipe_wan.vace_layers import split_into_layers

W, H, FRAMES, STEPS, SEED = 48, 32, 5, 3, 5
TABLE = {"type": "wan-vace", "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 8}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe(tiny_wan_vace: Path):
    from diffusers import WanVACEPipeline

    return WanVACEPipeline.from_pretrained(str(tiny_wan_vace), dtype=torch.float32, local_files_only=True)


def test_conditioning_equals_the_pipelines(pipe) -> None:
    """Control video, mask and two reference images: ``prepare_video_latents`` and ``prepare_masks`` concatenated,
    as ``WanVACEPipeline.__call__`` hands them to the transformer."""
    g = torch.Generator().manual_seed(0)
    video = torch.rand(1, 3, FRAMES, H, W, generator=g) * 2 - 1
    mask = (torch.rand(1, 1, FRAMES, H, W, generator=g) > 0.5).float()
    refs = torch.rand(1, 2, 3, H, W, generator=g) * 2 - 1
    for references, m in ((None, None), (None, mask), (refs, mask)):
        mask3 = (torch.ones_like(video) if m is None else m.expand(-1, 3, -1, -1, -1))
        listed = [[]] if references is None else [list(references[0])]  # as __call__ passes them
        with torch.no_grad():
            latents = pipe.prepare_video_latents(video, mask3, listed, device=CPU)
            masks = pipe.prepare_masks(mask3, listed)
        expected = torch.cat([latents, masks], dim=1)
        ours = vace_encoding.context(pipe.vae, video, m, references)
        assert ours.shape == (1, 2 * 4 + 64, 2 + (0 if references is None else 2), H // 8, W // 8)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def eight_bit(generator: torch.Generator, height: int, width: int) -> torch.Tensor:
    """An RGB image ``(3, H, W)`` in [-1, 1] as the core decodes an 8-bit file."""
    return torch.randint(0, 256, (3, height, width), generator=generator).float() / 127.5 - 1


def test_dataset_masks_and_reference_images_give_the_pipelines_conditioning(tiny_wan_vace: Path, pipe) -> None:
    """A control batch with ``control_masks`` (``control_mask_path``) and ``references`` (``reference_path``, images
    at their own sizes, tall and wide) caches what ``WanVACEPipeline`` computes from that video, mask and those PIL
    images: ``preprocess_conditions``' fitted references, ``prepare_video_latents``, ``prepare_masks``; and
    ``prepare_inputs`` puts the reference frames before the clip's, each trained toward its own latent."""
    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_wan.encoding import to_images
    from diffpipe_wan.vace import CONTROL

    cfg = validate(wan_vace.spec.config_schema, {**TABLE, "path": tiny_wan_vace}, "test")
    enc = wan_vace.load_encoders(model_config=cfg, device=CPU)
    g = torch.Generator().manual_seed(4)
    video = torch.rand(2, 3, FRAMES, H, W, generator=g) * 2 - 1
    masks = (torch.rand(2, 1, FRAMES, H, W, generator=g) > 0.5).float()
    refs = [(eight_bit(g, 40, 24), eight_bit(g, 16, 56)), (eight_bit(g, 32, 32), eight_bit(g, 24, 40))]
    batch = EncodeBatch(pixels=video, control_index=0, control_masks=masks, references=refs)
    context = wan_vace.encode_batch(encoders=enc, batch=batch)["context"]
    assert context.shape == (2, 72, 2 + 2, H // 8, W // 8)
    for i in range(2):
        images = [to_images(r[None])[0] for r in refs[i]]
        _, _, listed = pipe.preprocess_conditions(None, None, images, 1, H, W, FRAMES, torch.float32, CPU)
        mask3 = masks[i : i + 1].expand(-1, 3, -1, -1, -1)
        with torch.no_grad():
            expected = torch.cat([pipe.prepare_video_latents(video[i : i + 1], mask3, listed, device=CPU),
                                  pipe.prepare_masks(mask3, listed)], dim=1)
        torch.testing.assert_close(context[i : i + 1], expected, rtol=1e-5, atol=1e-6)

    latents = torch.randn(2, 4, 2, H // 8, W // 8, generator=g)
    train = {"latents": latents, "text_embeds": torch.randn(2, 8, 32), CONTROL: context}
    (x, t, _, control), (velocity,) = wan_vace.prepare_inputs(train, TrainingContext(cfg), torch.Generator())
    clean = torch.cat([context[:, :4, :2], latents], dim=2)  # the reference frames first, as the pipeline's latents
    t5 = t.view(-1, 1, 1, 1, 1)
    assert x.shape == control.shape[:1] + (4,) + control.shape[2:]
    torch.testing.assert_close(x, (1 - t5) * clean + t5 * (velocity + clean), rtol=1e-5, atol=1e-5)


def test_layers_chained_equal_the_forward(pipe) -> None:
    """Every VACE block before the transformer blocks; block ``vace_layers[i]`` adds hint ``i`` (block 1 adds none),
    the hints carried between layers; with reference frames the control is as long as the video."""
    model = pipe.transformer
    assert tuple(model.config.vace_layers) == VACE_LAYERS and len(model.blocks) == 3
    layers = split_into_layers(model)
    assert [type(layer).__name__ for layer in layers] == [
        "VaceEmbedLayer", "VaceBlockLayer", "VaceBlockLayer", *["VaceTransformerBlockLayer"] * 3, "HeadLayer"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 4, 6, generator=g)
    t = torch.rand(2, generator=g)
    text = torch.randn(2, 8, 32, generator=g)
    control = torch.randn(2, 72, 3, 4, 6, generator=g)
    with torch.no_grad():
        expected = model(x, t * 1000, text, control_hidden_states=control, return_dict=False)[0]
        out = (x, t, text, control)
        for layer in layers:
            out = layer(out)
            if isinstance(layer, type(layers[1])):  # the hints made so far travel on with the stream
                assert len(out) == 7 + (layer is layers[1]) + layers.index(layer)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def write_control(tmp_path: Path, seed: int) -> Path:
    return write_video(tmp_path / f"control-{seed}.mp4", FRAMES + 3, fps=16, size=(60, 40), seed=seed)


def test_wan_vace_conforms(tiny_wan_vace: Path, tmp_path: Path) -> None:
    pixels = torch.rand(2, 3, FRAMES, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    table = {**TABLE, "path": tiny_wan_vace, "sample_control": write_control(tmp_path, 1)}
    check_model_plugin(wan_vace, "wan-vace", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])


@pytest.mark.parametrize(("masked", "referenced"), [(False, False), (True, False), (True, True)])
def test_sample_equals_the_pipelines(tiny_wan_vace: Path, tmp_path: Path, pipe, masked: bool, referenced: bool) -> None:
    """The core's loop over the layers from the same noise, prompt embeddings and control video (decoded by the
    core at the sample's size and frame rate, given to the pipeline as that tensor) equals ``WanVACEPipeline``; with a
    ``sample_reference`` image (another aspect ratio) too, its latent frame in front, dropped when decoding."""
    from PIL import Image

    from diffpipe_core.testing.media import write_png

    control = write_control(tmp_path, 2)
    mask = write_control(tmp_path, 3) if masked else None
    reference = write_png(tmp_path / "reference.png", 24, 40, seed=4) if referenced else None
    cfg = validate(wan_vace.spec.config_schema, {**TABLE, "path": tiny_wan_vace, "sample_control": control,
                                                 "sample_mask": mask, "sample_reference": reference}, "test")
    handle = registered(wan_vace)
    (texts,) = encode_prompts(handle, cfg, ["a red cat walks"], "blurry", CPU)
    request = SampleRequest(width=W, height=H, frames=FRAMES, steps=STEPS)
    ours = sample_latents(handle, cfg, request, texts, SEED, 2.0)

    video = read_clip(control, (W, H, FRAMES), wan_vace.spec)  # (3, F, H, W) in [-1, 1]
    kwargs = {}
    if masked:  # the pipeline's masks are in [-1, 1] images: (mask + 1) / 2 after preprocessing
        kwargs["mask"] = [read_clip(mask, (W, H, FRAMES), wan_vace.spec)[:1].expand(3, -1, -1, -1).transpose(0, 1)]
    if referenced:
        with Image.open(reference) as opened:
            kwargs["reference_images"] = [opened.convert("RGB")]
    expected = pipe(
        video=[video.transpose(0, 1)],
        prompt_embeds=texts.cond["text_embeds"],
        negative_prompt_embeds=texts.uncond["text_embeds"],
        guidance_scale=2.0,
        latents=torch.randn((1, 4, 2 + referenced, H // 8, W // 8), generator=noise_generator(SEED, 0)),
        num_inference_steps=STEPS,
        height=H,
        width=W,
        num_frames=FRAMES,
        output_type="latent",
        **kwargs,
    ).frames
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    if referenced:  # decoded without the reference frame, as the pipeline decodes
        decoded = wan_vace.decode_latents(decoder=pipe.vae, latents=ours)
        assert decoded.shape == (1, 3, FRAMES, H, W)


def test_sampling_without_a_control_video_says_what_to_set(tiny_wan_vace: Path) -> None:
    cfg = validate(wan_vace.spec.config_schema, {**TABLE, "path": tiny_wan_vace}, "test")
    with pytest.raises(ValueError, match=r"set \[model\] sample_control to a video file"):
        wan_vace.denoise_init(SampleRequest(width=W, height=H, frames=FRAMES), cfg, noise_generator(SEED, 0))


def test_the_original_vace_file_loads_as_the_folder_whole_and_per_stage(tiny_wan_vace: Path) -> None:
    """ComfyUI's ``wan2.1_vace_*`` layout (the Wan repositories' ``VaceWanModel``): the single file loads to the
    folder's weights, is what diffusers' own converter reads, and each of 2 stages reads only its own tensors."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file

    from diffpipe_core.registry import Registry
    from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
    from diffpipe_wan.testing import single_file_path

    file = single_file_path(tiny_wan_vace)
    original = load_file(str(file))
    assert {"vace_patch_embedding.weight", "vace_blocks.0.before_proj.weight", "vace_blocks.1.after_proj.weight",
            "vace_blocks.1.self_attn.q.weight", "vace_blocks.0.modulation", "blocks.2.ffn.0.weight"} <= set(original)
    folder = load_file(str(tiny_wan_vace / "transformer" / "diffusion_pytorch_model.safetensors"))
    theirs = convert_wan_transformer_to_diffusers(dict(original))
    assert theirs.keys() == folder.keys() and all(torch.equal(theirs[k], folder[k]) for k in folder)

    cfg = validate(wan_vace.spec.config_schema, {**TABLE, "path": tiny_wan_vace, "diffusion_model": file}, "test")
    assert wan_vace.validate_model_files(cfg) == []
    single = wan_vace.load_diffusion_model(cfg, CPU, torch.float32).state_dict()
    assert single.keys() == folder.keys() and all(torch.equal(single[k], folder[k]) for k in folder)
    registry = Registry()
    assert registry.register_model("wan-vace", wan_vace).ok
    stages = assert_stages_read_their_own(registry.model("wan-vace"), cfg, stages=2)
    assert "vace_blocks.0.before_proj.weight" in stages[0].reads and "head.modulation" in stages[1].reads
