"""Unit tests of the SDXL plugin on a tiny SDXL written to disk: loading (folder and single file), encoding,
the pipeline layers against diffusers' UNet forward, the DDPM objective, and the conformance kit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionXLPipeline
from diffusers.training_utils import compute_snr
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffpipe_core import EncodeBatch, TrainingContext, ddpm
from diffpipe_core.data.decode import load_media
from diffpipe_core.data.items import Bucket, MediaItem
from diffpipe_core.parts.text import chunk_token_ids
from diffpipe_core.registry import get_registry
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.media import write_png
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_sdxl import sgm
from diffpipe_sdxl.config import SDXLConfig
from diffpipe_sdxl.layers import split_unet
from diffpipe_sdxl.plugin import plugin


def folder_cfg(folder: Path, **kw: object) -> SDXLConfig:
    return SDXLConfig(type="sdxl", path=folder, dtype="float32", **kw)


def file_cfg(folder: Path, file: Path, **kw: object) -> SDXLConfig:
    return SDXLConfig(type="sdxl", path=file, config_path=folder, dtype="float32", **kw)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), what
    bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


# ------------------------------------------------------------------------------------------------ loading
def test_folder_and_single_file_load_the_same_weights(tiny_sdxl: tuple[Path, Path]) -> None:
    folder, file = tiny_sdxl
    cpu = torch.device("cpu")
    a = plugin.load_diffusion_model(folder_cfg(folder), cpu, torch.float32)
    b = plugin.load_diffusion_model(file_cfg(folder, file), cpu, torch.float32)
    assert_same_state(a, b, "unet")
    ea, eb = plugin.load_encoders(folder_cfg(folder), cpu), plugin.load_encoders(file_cfg(folder, file), cpu)
    assert_same_state(ea.vae, eb.vae, "vae")
    for name in ("text_encoder", "text_encoder_2"):
        assert_same_state(getattr(ea, name), getattr(eb, name), name)
    # and the diffusers pipeline itself reads our folder
    pipe = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
    assert_same_state(pipe.unet, a, "pipeline unet")


def test_per_stage_key_map_covers_the_single_file(tiny_sdxl: tuple[Path, Path]) -> None:
    """Each of 2 stages reads from the single file only its own UNet tensors (counted on the real reader), the two
    together exactly the file's UNet tensors, and gets the weights a whole load gives."""
    folder, file = tiny_sdxl
    stages = assert_stages_read_their_own(get_registry().model("sdxl"), file_cfg(folder, file))
    with safe_open(str(file), "pt") as f:
        assert set(stages[0].reads) | set(stages[1].reads) == {k for k in f.keys() if k.startswith(sgm.UNET)}
    [(path, key_map)] = plugin.diffusion_model_weights(file_cfg(folder, file))
    unet = plugin.load_diffusion_model(folder_cfg(folder), torch.device("cpu"), torch.float32).state_dict()
    mapped = {key_map(k): v for k, v in load_file(str(path)).items() if key_map(k) is not None}
    assert mapped.keys() == unet.keys()
    assert all(torch.equal(mapped[k], unet[k]) for k in unet)


def test_single_file_with_unexpected_unet_key_is_rejected(tiny_sdxl: tuple[Path, Path], tmp_path: Path) -> None:
    folder, file = tiny_sdxl
    state = load_file(str(file))
    state["model.diffusion_model.input_blocks.99.0.weight"] = torch.zeros(1)
    bad = tmp_path / "bad.safetensors"
    save_file(state, str(bad))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*input_blocks\.99\.0\.weight"):
        plugin.load_diffusion_model(file_cfg(folder, bad), torch.device("cpu"), torch.float32)


def test_bad_folders_are_named(tiny_sdxl: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"empty: not a diffusers SDXL folder"):
        plugin.load_diffusion_model(folder_cfg(tmp_path / "empty"), torch.device("cpu"), torch.float32)
    weightless = tmp_path / "weightless"
    (weightless / "unet").mkdir(parents=True)
    (weightless / "unet" / "config.json").write_text((tiny_sdxl[0] / "unet" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"weightless/unet: no UNet weights"):
        plugin.diffusion_model_weights(folder_cfg(weightless))


def test_single_file_needs_config_path(tiny_sdxl: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="config_path"):
        SDXLConfig(type="sdxl", path=tiny_sdxl[1])


# ------------------------------------------------------------------------------------------------ encoding
def test_time_ids_reflect_the_actual_crop(tiny_sdxl: tuple[Path, Path], tmp_path: Path) -> None:
    """A 96x64 (w x h) image in a 64x64 bucket is center-cropped 16 px from the left; a 64x128 one 32 px from
    the top after no resize. The data pipeline's decode reports it and encode_batch turns it into time_ids."""
    encoders = plugin.load_encoders(folder_cfg(tiny_sdxl[0]), torch.device("cpu"))
    decoded = []
    for i, (w, h) in enumerate([(96, 64), (64, 128)]):
        path = write_png(tmp_path / f"{i}.png", w, h)
        item = MediaItem(id=str(path), path=path, caption="", bucket=Bucket(64, 64), content_key=str(i))
        decoded.append(load_media(item, plugin.model_spec()))
    batch = EncodeBatch(
        pixels=torch.stack([d.pixels for d in decoded]),
        original_sizes=[d.original_size for d in decoded],
        crop_coords=[d.crop_coords for d in decoded],
    )
    out = plugin.encode_batch(encoders, batch)
    expected = torch.tensor([[64, 96, 0, 16, 64, 64], [128, 64, 32, 0, 64, 64]], dtype=torch.float32)
    assert torch.equal(out["time_ids"], expected)
    assert out["latents"].shape == (2, 4, 8, 8)
    vae = encoders.vae
    with torch.no_grad():
        raw = vae.encode(batch.pixels).latent_dist.mean
    assert torch.allclose(out["latents"], raw * 0.13025)


def test_text_encoding_matches_diffusers_and_chunks_long_prompts(tiny_sdxl: tuple[Path, Path]) -> None:
    folder = tiny_sdxl[0]
    encoders = plugin.load_encoders(folder_cfg(folder, max_prompt_chunks=2), torch.device("cpu"))
    long = " ".join(["cat"] * 100)  # 100 tokens: 2 chunks
    out = plugin.encode_batch(encoders, EncodeBatch(captions=["a photo of a dog", long]))
    assert out["text_embeds"].shape == (2, 154, 64) and out["pooled"].shape == (2, 32)
    assert out["text_mask"][0].tolist() == [True] * 77 + [False] * 77
    assert out["text_mask"][1].all()
    pipe = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt("a photo of a dog", do_classifier_free_guidance=False)
    assert torch.allclose(out["text_embeds"][0, :77], embeds[0], atol=1e-6)
    assert torch.allclose(out["pooled"][0], pooled[0], atol=1e-6)
    assert (out["text_embeds"][0, 77:] == 0).all()
    ids, mask = chunk_token_ids(encoders.tokenizer, [long], 3)
    tok = encoders.tokenizer
    body = tok(long, add_special_tokens=False)["input_ids"]
    assert len(body) == 100
    assert mask.tolist() == [[True, True, False]]
    assert ids[0, 0].tolist() == [tok.bos_token_id, *body[:75], tok.eos_token_id]
    assert ids[0, 1, : 2 + len(body) - 75].tolist() == [tok.bos_token_id, *body[75:], tok.eos_token_id]


# ------------------------------------------------------------------------------------------------ layers
def test_layers_reproduce_the_unet_forward(tiny_sdxl: tuple[Path, Path]) -> None:
    unet = plugin.load_diffusion_model(folder_cfg(tiny_sdxl[0]), torch.device("cpu"), torch.float32).eval()
    layers = split_unet(unet)
    assert len(layers) == 1 + 2 * 2 + 2 + 2 * 3 + 1  # embed, 2 resnets per down block, mid, 3 per up block, out
    torch.manual_seed(0)
    x, t = torch.randn(2, 4, 8, 16), torch.tensor([10, 700])
    text, pooled = torch.randn(2, 154, 64), torch.randn(2, 32)
    mask = torch.tensor([[True] * 77 + [False] * 77, [True] * 154])
    time_ids = torch.tensor([[64.0, 128, 0, 0, 64, 128], [100, 200, 3, 5, 64, 128]])
    state: tuple[torch.Tensor, ...] = (x, t, text, mask, pooled, time_ids)
    with torch.no_grad():
        for layer in layers:
            state = layer(state)
        expected = unet(
            x, t, text, encoder_attention_mask=mask, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}
        ).sample
        cond = {"text_embeds": pooled[:1], "time_ids": time_ids[:1]}
        short = unet(x[:1], t[:1], text[:1, :77], added_cond_kwargs=cond)
    assert len(state) == 1
    assert torch.allclose(state[0], expected, atol=1e-5), (state[0] - expected).abs().max()
    # a masked-out chunk is exactly as if the prompt had only its valid chunks
    assert torch.allclose(state[0][:1], short.sample, atol=1e-5)


def test_conformance(tiny_sdxl: tuple[Path, Path]) -> None:
    folder, file = tiny_sdxl
    table = {"type": "sdxl", "path": str(file), "config_path": str(folder), "dtype": "float32"}
    pixels = torch.rand(2, 3, 64, 64) * 2 - 1
    check_model_plugin(plugin, "sdxl", table, pixels=pixels, captions=["a cat", "a dog"])


# ------------------------------------------------------------------------------------------------ objective
def _batch(n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "latents": torch.randn(n, 4, 8, 8, generator=g),
        "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * n),
        "text_embeds": torch.randn(n, 77, 64, generator=g),
        "text_mask": torch.ones(n, 77, dtype=torch.bool),
        "pooled": torch.randn(n, 32, generator=g),
    }


@pytest.mark.parametrize("ztsnr", [False, True])
def test_v_prediction_and_min_snr_match_their_formulas(ztsnr: bool) -> None:
    """Checked against diffusers' DDPMScheduler (add_noise, get_velocity, rescale_betas_zero_snr) and
    diffusers.training_utils.compute_snr."""
    cfg = SDXLConfig(type="sdxl", path=Path("."), v_pred=True, zero_terminal_snr=ztsnr, min_snr_gamma=5.0)
    sched = DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", rescale_betas_zero_snr=ztsnr
    )
    assert torch.allclose(ddpm.alphas_cumprod(zero_terminal_snr=ztsnr).float(), sched.alphas_cumprod, atol=1e-6)
    batch = _batch()
    generator = torch.Generator().manual_seed(3)
    (x_t, t, *_), (target, weights) = plugin.prepare_inputs(batch, TrainingContext(cfg), generator)
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(batch["latents"].shape, generator=g)
    assert torch.equal(t, torch.randint(0, 1000, (4,), generator=g))
    assert torch.allclose(x_t, sched.add_noise(batch["latents"], noise, t), atol=1e-5)
    assert torch.allclose(target, sched.get_velocity(batch["latents"], noise, t), atol=1e-5)
    snr = compute_snr(sched, t)
    assert torch.allclose(weights, torch.minimum(snr, torch.tensor(5.0)) / (snr + 1), atol=1e-6)
    # epsilon prediction: min(snr, gamma) / snr, and the target is the noise
    eps_cfg = cfg.model_copy(update={"v_pred": False})
    _, (target, weights) = plugin.prepare_inputs(batch, TrainingContext(eps_cfg), torch.Generator().manual_seed(3))
    assert torch.equal(target, noise)
    assert torch.allclose(weights, torch.minimum(snr, torch.tensor(5.0)) / snr, atol=1e-6)


def test_loss_weighting_mask_noise_offset_and_eval_quantile() -> None:
    cfg = SDXLConfig(type="sdxl", path=Path("."), debiased_estimation=True, noise_offset=0.1)
    batch = {**_batch(2), "mask": torch.ones(2, 1, 8, 8)}
    batch["mask"][1] = 0
    inputs, targets = plugin.prepare_inputs(batch, TrainingContext(cfg, eval_quantile=0.5), torch.Generator())
    assert inputs[1].tolist() == [500, 500]
    snr = ddpm.snr(ddpm.alphas_cumprod()[500])
    assert torch.allclose(targets[1], (1 / snr.sqrt()).float().expand(2))
    pred = torch.zeros_like(targets[0])
    loss = plugin.compute_loss((pred,), targets)
    expected = (targets[1][0] * targets[0][0] ** 2).mean()  # sample 1 is masked out
    assert torch.allclose(loss, expected, atol=1e-6)


def test_sdxl_topology_layers_and_single_file_names(tmp_path: Path) -> None:
    """SDXL's real block layout (3 levels, no downsampler on the last, attention in 2 of 3 up blocks, several
    transformer layers), tiny channels: the layers reproduce the forward, and the original-layout names load
    back through diffusers' single-file converter."""
    from diffusers import UNet2DConditionModel

    from diffpipe_sdxl.testing import TINY_UNET

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        **{
            **TINY_UNET,
            "block_out_channels": (32, 32, 64),
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            "attention_head_dim": (2, 2, 4),
            "transformer_layers_per_block": (1, 1, 2),
        }
    ).eval()
    assert len(split_unet(unet)) == 1 + 6 + 2 + 9 + 1
    original = assert_layers_and_sgm_names_round_trip(unet, torch.randn(1, 4, 16, 8), tmp_path)
    assert "model.diffusion_model.output_blocks.2.2.conv.weight" in original  # upsampler after an attention
    assert "model.diffusion_model.input_blocks.6.0.op.weight" in original


def assert_layers_and_sgm_names_round_trip(unet, x: torch.Tensor, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The pipeline layers reproduce the UNet's forward, and its original-layout (SGM) state dict loads back
    through diffusers' single-file converter to the same weights. Returns that state dict."""
    from diffusers import UNet2DConditionModel

    t = torch.tensor([321])
    text, pooled = torch.randn(1, 77, 64), torch.randn(1, 32)
    h, w = x.shape[-2] * 8, x.shape[-1] * 8
    mask, time_ids = torch.ones(1, 77, dtype=torch.bool), torch.tensor([[float(h), w, 0, 0, h, w]])
    state: tuple[torch.Tensor, ...] = (x, t, text, mask, pooled, time_ids)
    with torch.no_grad():
        for layer in split_unet(unet):
            state = layer(state)
        expected = unet(x, t, text, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
    assert torch.allclose(state[0], expected, atol=1e-5)

    unet.save_pretrained(tmp_path / "cfg" / "unet")
    original = sgm.unet_table(unet.config).to_original(unet.state_dict())
    save_file({k: v.contiguous() for k, v in original.items()}, str(tmp_path / "unet.safetensors"))
    loaded = UNet2DConditionModel.from_single_file(
        str(tmp_path / "unet.safetensors"), config=str(tmp_path / "cfg"), subfolder="unet", local_files_only=True
    )
    assert_same_state(loaded, unet, "unet")
    return original


@pytest.mark.parametrize("mid_block_type", ["UNetMidBlock2D", None])
def test_sdxl_family_unets_without_a_cross_attention_mid_block(mid_block_type: str | None, tmp_path: Path) -> None:
    """Issue 9.14: Segmind Vega and SSD-1B are SDXL UNets whose mid block is a lone resnet (``UNetMidBlock2D``)
    or absent. The layers reproduce diffusers' forward, and the original-layout names load back."""
    from diffusers import UNet2DConditionModel

    from diffpipe_sdxl.testing import TINY_UNET

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**{**TINY_UNET, "mid_block_type": mid_block_type}).eval()
    assert len(split_unet(unet)) == 1 + 2 * 2 + (1 if mid_block_type else 0) + 2 * 3 + 1
    original = assert_layers_and_sgm_names_round_trip(unet, torch.randn(1, 4, 8, 8), tmp_path)
    assert any(k.startswith("model.diffusion_model.middle_block.0.") for k in original) == (mid_block_type is not None)
    assert not any(k.startswith("model.diffusion_model.middle_block.1.") for k in original)
