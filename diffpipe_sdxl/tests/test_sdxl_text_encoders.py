"""SDXL text-encoder training (issue 26): with ``train_text_encoders`` the captions are cached as token ids, both CLIP
encoders sit in the first pipeline stage, and LoRA (or full fine-tuning) trains them with the UNet at their own
learning rates (``[optimizer] group_lr`` of the groups the ``parameter_groups`` hook names).

One 2-stage LoRA run (from the diffusers folder, sampling before its first step) serves: the encoders' LoRA in
stage 0 trained, each group's learning rate, the saved diffusers file (``text_encoder.``/``text_encoder_2.`` keys)
reproducing the trained encoders and UNet through ``StableDiffusionXLPipeline.load_lora_weights``, the kohya file
(``lora_te1_``/``lora_te2_`` keys) in ComfyUI's key map and applied by its formula, and through diffusers' kohya
converter. In process: per-stage loading of the encoders from the single file, and a full fine-tune's exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffpipe_core.adapters import read_adapter
from diffpipe_core.engine.checkpoint import read_optimizer_state
from diffpipe_core.engine.saving import write_model_shards
from diffpipe_core.registry import get_registry
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.testing import runs
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_sdxl import sgm
from diffpipe_sdxl.config import SDXLConfig
from diffpipe_sdxl.encoding import conditioning
from diffpipe_sdxl.plugin import plugin as sdxl

RANK, ALPHA = 4, 8.0
LRS = {"text_encoder_1": 2e-3, "text_encoder_2": 3e-3, "unet": 5e-3}
MODEL = "\ntrain_text_encoders = true\n"
GROUP_LR = f"""
[optimizer.group_lr]
text_encoder_1 = {LRS["text_encoder_1"]}
text_encoder_2 = {LRS["text_encoder_2"]}
"""
# ComfyUI's comfy/lora.py: LORA_CLIP_MAP and the SDXL names of model_lora_keys_clip / model_lora_keys_unet
LORA_CLIP_MAP = {
    "mlp.fc1": "mlp_fc1",
    "mlp.fc2": "mlp_fc2",
    "self_attn.k_proj": "self_attn_k_proj",
    "self_attn.q_proj": "self_attn_q_proj",
    "self_attn.v_proj": "self_attn_v_proj",
    "self_attn.out_proj": "self_attn_out_proj",
}


def te_config(path: Path, **kw: object) -> SDXLConfig:
    return SDXLConfig(type="sdxl", path=path, dtype="float32", max_prompt_chunks=2, train_text_encoders=True, **kw)


@pytest.fixture(scope="module")
def te_run(tiny_sdxl: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LoRA on the UNet and both text encoders, 2 pipeline stages, from the diffusers folder, sampling at step 0."""
    from test_sdxl_train import SAMPLE_TABLE, make_project

    root = tmp_path_factory.mktemp("text_encoders")
    tables = GROUP_LR + SAMPLE_TABLE.replace("every_n_steps = 4", "every_n_steps = 100")
    project = make_project(root, tiny_sdxl, 2, 4, single_file=False, lora=True, model=MODEL, tables=tables)
    return runs.train(root, project, procs=2)


def ids_and_inputs() -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (2, 2, 77), generator=g)
    chunks = torch.tensor([[True, False], [True, True]])
    x, t = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([100, 800])
    return (ids, chunks), {"sample": x, "timestep": t, "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}


def outputs(te1, te2, unet) -> torch.Tensor:
    """Both encoders' conditioning of fixed token ids, then the UNet on it: one tensor that moves with any LoRA."""
    (ids, chunks), x = ids_and_inputs()
    with torch.no_grad():
        text, mask, pooled = conditioning((te1, te2), (ids, ids), (chunks, chunks))
        added = {"text_embeds": pooled, "time_ids": x["time_ids"]}
        out = unet(x["sample"], x["timestep"], text, encoder_attention_mask=mask, added_cond_kwargs=added).sample
    return torch.cat([text.flatten(), pooled.flatten(), out.flatten()])


@pytest.fixture(scope="module")
def reference(te_run: Path, tiny_sdxl: tuple[Path, Path]) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    """``(untrained, trained)`` outputs and the trained model: the UNet holding both encoders with the checkpoint's
    LoRA tensors applied by peft."""
    model = sdxl.load_diffusion_model(te_config(tiny_sdxl[0]), torch.device("cpu"), torch.float32)
    untrained = outputs(model.text_encoder, model.text_encoder_2, model)
    targets = read_adapter(te_run / "saved" / "final")[1]["target_modules"]
    model = runs.with_trained_lora(model, te_run, RANK, ALPHA, targets)
    return untrained, outputs(model.text_encoder, model.text_encoder_2, model), model


def pipeline(folder: Path):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(str(folder), local_files_only=True)


@pytest.mark.slow
def test_text_encoders_train_in_stage_0_at_their_learning_rates(te_run: Path) -> None:
    losses = runs.losses(te_run)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    ckpt = sorted((te_run / "checkpoints").glob("step-*"))[-1]
    first = load_file(str(ckpt / "params-stage0.safetensors"))
    for part, layers in (("text_encoder.", 1), ("text_encoder_2.", 2)):  # text_encoder's last layer reaches nothing
        lora_b = [v for k, v in first.items() if k.startswith(part) and "lora_B" in k]
        assert len(lora_b) == layers * 6 and all(v.abs().max() > 0 for v in lora_b), part  # 6 linears a layer
    second = load_file(str(ckpt / "params-stage1.safetensors"))
    assert not any(k.startswith("text_encoder") for k in second), "the encoders left the first stage"
    groups = read_optimizer_state(ckpt, 0)["optimizer"]["param_groups"]
    assert {g["name"] for g in groups} == {"text_encoder_1", "text_encoder_2", "unet"}
    assert all(g["initial_lr"] == pytest.approx(LRS[g["name"]]) for g in groups)
    (only,) = read_optimizer_state(ckpt, 1)["optimizer"]["param_groups"]  # one group: passed as a plain list
    assert only["initial_lr"] == pytest.approx(LRS["unet"])


@pytest.mark.slow
def test_diffusers_lora_of_the_text_encoders_loads_in_the_pipeline(te_run: Path, tiny_sdxl, reference) -> None:
    untrained, expected, _ = reference
    saved = te_run / "saved" / "final" / "adapter_model.safetensors"
    state, cfg = read_adapter(saved.parent)
    assert {k.split(".", 1)[0] for k in state} == {"unet", "text_encoder", "text_encoder_2"}
    assert "text_encoder.encoder.layers.0.self_attn.q_proj.lora_A.weight" in state
    assert "text_encoder_2.text_model.encoder.layers.1.mlp.fc2.lora_B.weight" in state
    with safe_open(str(saved), "pt") as f:
        metadata = f.metadata()["lora_adapter_metadata"]
    assert '"text_encoder.lora_alpha": 4.0' in metadata and '"text_encoder_2.r": 4' in metadata
    pipe = pipeline(tiny_sdxl[0])
    runs.load_lora_into(pipe, saved)  # every tensor lands in its component unchanged, nothing left over
    runs.assert_reproduces(outputs(pipe.text_encoder, pipe.text_encoder_2, pipe.unet), expected, untrained, 1e-4)


def comfyui_key_map(folder: Path, file: Path) -> dict[str, str]:
    """ComfyUI's SDXL LoRA key map (``model_lora_keys_clip``: ``lora_te1_``/``lora_te2_text_model_encoder_layers_N_*``
    for ``LORA_CLIP_MAP``'s linears; ``model_lora_keys_unet``: ``lora_unet_<SGM module>``) to this model's weights."""
    out = {}
    for b in range(2):
        for c, short in LORA_CLIP_MAP.items():
            layer = f"encoder.layers.{b}.{c}.weight"  # transformers 5: CLIPTextModel has no text_model. level
            out[f"lora_te1_text_model_encoder_layers_{b}_{short}"] = f"text_encoder.{layer}"
            out[f"lora_te2_text_model_encoder_layers_{b}_{short}"] = f"text_encoder_2.text_model.{layer}"
    with safe_open(str(file), "pt") as f:
        keys = [k for k in f.keys() if k.startswith(sgm.UNET) and k.endswith(".weight")]
    to_model = sgm.unet_table(sdxl.folder.model_config(folder)).key_map(keys)
    out.update({"lora_unet_" + k[len(sgm.UNET) : -len(".weight")].replace(".", "_"): to_model(k) for k in keys})
    return out


@pytest.mark.slow
def test_kohya_lora_of_the_text_encoders_fits_comfyui_and_diffusers(te_run: Path, tiny_sdxl, reference) -> None:
    untrained, expected, _ = reference
    kohya = load_file(str(te_run / "saved" / "final" / "adapter_model.kohya.safetensors"))
    modules = {k.split(".")[0] for k in kohya}
    names = LORA_CLIP_MAP.values()
    clip = {f"lora_te{n}_text_model_encoder_layers_{b}_{v}" for n, b in ((1, 0), (2, 0), (2, 1)) for v in names}
    assert {m for m in modules if m.startswith("lora_te")} == clip
    assert float(kohya["lora_te2_text_model_encoder_layers_0_self_attn_q_proj.alpha"]) == RANK

    # ComfyUI maps every module and applies W += alpha / rank * up @ down: the trained UNet and encoders
    key_map = comfyui_key_map(*tiny_sdxl)
    base = sdxl.load_diffusion_model(te_config(tiny_sdxl[0]), torch.device("cpu"), torch.float32).state_dict()
    applied = dict(base)
    for module in modules:
        down, up = kohya[f"{module}.lora_down.weight"], kohya[f"{module}.lora_up.weight"]
        weight = key_map[module]
        applied[weight] = applied[weight] + float(kohya[f"{module}.alpha"]) / down.shape[0] * up @ down
    runs.assert_state_close(applied, runs.merge_peft(base, runs.checkpoint_params(te_run), ALPHA / RANK))

    # diffusers' kohya converter (lora_unet_ / lora_te1_ / lora_te2_ -> its components)
    pipe = pipeline(tiny_sdxl[0])
    pipe.load_lora_weights(kohya)
    runs.assert_reproduces(outputs(pipe.text_encoder, pipe.text_encoder_2, pipe.unet), expected, untrained, 1e-4)


@pytest.mark.slow
def test_text_encoder_run_samples_like_the_pipeline(te_run: Path, tiny_sdxl: tuple[Path, Path]) -> None:
    """Step 0 (LoRA B = 0): the encoders in the pipeline's first stage encode the prompt as caching does."""
    from test_sdxl_sampling import PROMPT, pipeline_latents

    folder = tiny_sdxl[0]
    got = load_file(str(te_run / "samples" / "step-0000000" / "latents.safetensors"))["sample_00"]
    cfg = SDXLConfig(type="sdxl", path=folder, dtype="float32", max_prompt_chunks=2)
    (texts,) = encode_prompts(get_registry().model("sdxl"), cfg, [PROMPT], None, torch.device("cpu"))
    torch.testing.assert_close(got, pipeline_latents(folder, texts), rtol=1e-4, atol=1e-5)


def test_text_encoder_learning_rates_need_train_text_encoders(tiny_sdxl, tmp_path: Path) -> None:
    from test_sdxl_train import make_project

    from diffpipe_core.config import load_config
    from diffpipe_core.schema import ConfigError

    project = make_project(tmp_path, tiny_sdxl, 1, 1, single_file=False, lora=True, tables=GROUP_LR)
    with pytest.raises(ConfigError) as err:
        load_config(project, get_registry())
    refused = [f"model 'sdxl' has no parameter group '{name}'; its groups: 'unet' (or write a parameter name pattern "
               'with * such as "*.attn*")' for name in LRS if name != "unet"]
    assert [p.split("optimizer.group_lr: ")[-1] for p in err.value.problems] == refused
    trained = sdxl.parameter_groups(te_config(tiny_sdxl[0]))
    assert trained == {"unet": [], "text_encoder_1": [r"text_encoder\."], "text_encoder_2": [r"text_encoder_2\."]}


def test_text_encoders_load_per_stage_from_the_single_file(tiny_sdxl: tuple[Path, Path]) -> None:
    folder, file = tiny_sdxl
    cfg = te_config(file, config_path=folder)
    stages = assert_stages_read_their_own(get_registry().model("sdxl"), cfg)
    assert stages[0].tensors.keys() >= {"text_encoder.embeddings.token_embedding.weight"}
    assert any(k.startswith(sgm.CLIP_G) and k.endswith("in_proj_weight") for k in stages[0].reads)
    assert not any(k.startswith(("text_encoder", "conditioner")) for k in [*stages[1].tensors, *stages[1].reads])


def test_full_finetune_of_the_text_encoders_exports(tiny_sdxl: tuple[Path, Path], tmp_path: Path) -> None:
    """A full fine-tune that trained the encoders exports them too: diffusers folders ``text_encoder/`` and
    ``text_encoder_2/`` beside ``unet/``, and the single file in the SGM layout (diffusers reads both back)."""
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    folder = tiny_sdxl[0]
    cfg = te_config(folder)
    model = sdxl.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    trained = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    saved = tmp_path / "saved"
    kw = {"rank": 0, "stage_id": 0, "dp_rank": 0, "num_stages": 1, "dtype": torch.float32, "barrier": lambda: None}
    write_model_shards(saved, trained, **kw)
    for fmt in ("diffusers", "single_file"):
        assert sdxl.export_model(saved, cfg, tmp_path / fmt, fmt)
    single = StableDiffusionXLPipeline.from_single_file(
        str(tmp_path / "single_file" / "sdxl.safetensors"), config=str(folder), local_files_only=True
    )
    out = tmp_path / "diffusers"
    loaded = {
        "": [single.unet, UNet2DConditionModel.from_pretrained(str(out / "unet"), local_files_only=True)],
        "text_encoder.": [single.text_encoder, CLIPTextModel.from_pretrained(str(out / "text_encoder"))],
        "text_encoder_2.": [single.text_encoder_2, CLIPTextModelWithProjection.from_pretrained(out / "text_encoder_2")],
    }
    for prefix, models in loaded.items():
        for m in models:
            state = m.state_dict()
            assert all(torch.equal(state[k], trained[prefix + k]) for k in state), (prefix, type(m).__name__)
    base = pipeline(folder).vae.state_dict()
    assert all(torch.equal(single.vae.state_dict()[k], v) for k, v in base.items())
