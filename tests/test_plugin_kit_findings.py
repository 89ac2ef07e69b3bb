"""What a third-party plugin author hit (issue 8), each fixed in the core and checked here.

The plugins below are the reference plugin with one thing changed, registered the way the conformance kit
registers any plugin: a model with a top-level parameter and float32-kept modules (like diffusers' Wan,
LTX-Video and PixArt), one whose layer copies that parameter, one whose layer returns a float tensor no
later layer uses, and a video model (plus one that cannot take image batches).
"""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from torch import nn

import diffpipe_reference.plugin as reference
from diffpipe_core import EncodeBatch, hookimpl
from diffpipe_core.adapters import lora_config
from diffpipe_core.cli import main as cli
from diffpipe_core.config import load_config
from diffpipe_core.engine.model_loading import cast_skeleton, load_for_stages, materialise_layers
from diffpipe_core.engine.partition import stage_parts
from diffpipe_core.engine.saving import write_adapter
from diffpipe_core.registry import PluginError, Registry, get_registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import run_diffpipe
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_reference.layers import BlockLayer, EmbedLayer, FinalLayer
from diffpipe_reference.model import TinyDiT, read_config, write_tiny_model
from diffpipe_reference.variants import ReferenceTraining

PIXELS = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1


class TableDiT(TinyDiT):
    """TinyDiT with a top-level ``scale_shift_table`` and a module diffusers keeps in float32."""

    _keep_in_fp32_modules = ["t_embedder"]

    def __init__(self, config) -> None:
        super().__init__(config)
        self.scale_shift_table = nn.Parameter(torch.randn(2, config.dim) / config.dim**0.5)


class TableFinal(nn.Module):
    """The final layer, also holding the model's top-level table (or, when ``copy``, a copy of it)."""

    def __init__(self, model: TableDiT, copy: bool = False) -> None:
        super().__init__()
        self.final = FinalLayer(model)
        table = model.scale_shift_table
        self.scale_shift_table = nn.Parameter(table.detach().clone()) if copy else table

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, c, hw = inputs
        shift, scale = self.scale_shift_table.to(tokens.dtype)
        return self.final((tokens * (1 + scale) + shift, c, hw))


def write_table_model(folder: Path) -> Path:
    write_tiny_model(folder)
    torch.manual_seed(1)
    state = {k: v.contiguous() for k, v in TableDiT(read_config(folder)).state_dict().items()}
    save_file(state, str(folder / "transformer.safetensors"), metadata={"format": "pt"})
    return folder


class TablePlugin(ReferenceTraining):
    """The reference plugin on :class:`TableDiT`; its skeleton is cast the way ``from_pretrained`` casts."""

    copy_table = False

    @hookimpl
    def load_diffusion_model(self, model_config, device, dtype):
        with torch.device("meta"):
            model = TableDiT(read_config(model_config.path))
        if device.type != "meta":
            model = model.to_empty(device=device)
            model.load_state_dict(load_file(str(model_config.path / "transformer.safetensors")), strict=True)
        return cast_skeleton(model, dtype)

    @hookimpl
    def split_into_layers(self, model, model_config):
        return [EmbedLayer(model), *(BlockLayer(b) for b in model.blocks), TableFinal(model, self.copy_table)]


class CopiedTablePlugin(TablePlugin):
    copy_table = True


def registered(plugin_obj: object):
    registry = Registry()
    assert registry.register_model("reference", plugin_obj).ok
    return registry.model("reference")


@pytest.fixture
def table_model(tmp_path: Path):
    plugin = registered(TablePlugin())
    cfg = plugin.spec.config_schema(type="reference", path=write_table_model(tmp_path / "m"))
    return plugin, cfg, load_file(str(tmp_path / "m" / "transformer.safetensors"))


# ----------------------------------------------------------------------- 1. top-level parameters
def test_a_layer_holding_a_top_level_parameter_sees_the_loaded_tensor(table_model) -> None:
    plugin, cfg, file = table_model
    stage = load_for_stages(plugin, cfg, torch.device("cpu"), torch.float32)
    parts = stage_parts(stage.layers, 2)
    materialise_layers(plugin, cfg, stage, range(parts[1], parts[2]), torch.device("cpu"))
    final = stage.layers[-1]
    assert final.scale_shift_table is stage.model.scale_shift_table
    assert final.scale_shift_table.device.type == "cpu"
    assert torch.equal(final.scale_shift_table, file["scale_shift_table"])


def test_the_kit_accepts_a_model_with_a_top_level_parameter(tmp_path: Path) -> None:
    check_model_plugin(
        TablePlugin(), "reference", {"type": "reference", "path": write_table_model(tmp_path / "m")}, PIXELS, ["a", "b"]
    )


def test_the_kit_names_a_parameter_a_layer_copied(tmp_path: Path) -> None:
    """Per-stage loading meets the copy first; both it and the kit's own check name the parameter."""
    with pytest.raises(PluginError, match=r"layer 5 \(TableFinal\) holds 'scale_shift_table', which is not the"):
        check_model_plugin(
            CopiedTablePlugin(),
            "reference",
            {"type": "reference", "path": write_table_model(tmp_path / "m")},
            PIXELS,
            ["a", "b"],
        )


def test_the_kits_own_share_check_names_the_parameter(tmp_path: Path) -> None:
    from diffpipe_core.testing.conformance import _check_layers_share_the_model

    model = TableDiT(read_config(write_tiny_model(tmp_path / "m")))
    with pytest.raises(AssertionError, match=r"layer 1 \(TableFinal\) holds 'scale_shift_table', which is not"):
        _check_layers_share_the_model(model, [EmbedLayer(model), TableFinal(model, copy=True)])


# ------------------------------------------------------------------------ 2. float32-kept modules
def test_per_stage_loading_keeps_the_skeletons_float32_modules(table_model) -> None:
    plugin, cfg, file = table_model
    stage = load_for_stages(plugin, cfg, torch.device("cpu"), torch.bfloat16)
    materialise_layers(plugin, cfg, stage, range(len(stage.layers)), torch.device("cpu"))
    loaded = stage.model.state_dict()
    assert loaded["t_embedder.0.weight"].dtype == torch.float32
    assert torch.equal(loaded["t_embedder.0.weight"], file["t_embedder.0.weight"])
    assert loaded["blocks.0.fc1.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["blocks.0.fc1.weight"], file["blocks.0.fc1.weight"].to(torch.bfloat16))
    whole = plugin.require("load_diffusion_model", model_config=cfg, device=torch.device("cpu"), dtype=torch.bfloat16)
    for key, value in whole.state_dict().items():
        assert value.dtype == loaded[key].dtype and torch.equal(value, loaded[key]), key


# ---------------------------------------------------------------------- 3. the stage-boundary rule
class SpareOutputEmbed(EmbedLayer):
    def forward(self, inputs):
        tokens, c, hw = super().forward(inputs)
        return tokens, c, hw, tokens.mean(-1)


class DropsSpare(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs):
        return self.layer(inputs[:3])


class SpareOutputPlugin(ReferenceTraining):
    """The embedder returns a 4th float tensor the first block drops: fine unless a stage ends at layer 0."""

    @hookimpl
    def split_into_layers(self, model, model_config):
        blocks = [BlockLayer(b) for b in model.blocks]
        return [SpareOutputEmbed(model), DropsSpare(blocks[0]), *blocks[1:], FinalLayer(model)]


def test_the_kit_checks_the_boundary_rule_at_every_layer(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "m")
    with pytest.raises(AssertionError, match=r"output 3 of layer 0 \(SpareOutputEmbed\).*no later layer uses"):
        check_model_plugin(
            SpareOutputPlugin(), "reference", {"type": "reference", "path": tmp_path / "m"}, PIXELS, ["a", "b"]
        )


# ---------------------------------------------------------------------------- 4. export formats
RUN = """
output_dir = "out"
dataset = "dataset.toml"
micro_batch_size_per_gpu = 1
{extra}
[model]
type = "reference"
path = "model"
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    write_tiny_model(tmp_path / "model")
    write_image_dataset(tmp_path / "images", 2, size=[(32, 32)] * 2)
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "images", resolutions=[32])
    return tmp_path


def test_undeclared_save_formats_are_refused_before_training(project: Path) -> None:
    extra = 'save_model_formats = ["single_file"]\n[adapter]\nrank = 4\nsave_formats = ["diffusers", "comfyui"]'
    (project / "run.toml").write_text(RUN.format(extra=extra))
    with pytest.raises(ConfigError) as err:
        load_config(project / "run.toml", get_registry())
    text = "\n".join(err.value.problems)
    assert "adapter.save_formats: model 'reference' cannot export format 'comfyui'; it exports: 'diffusers'" in text
    assert "save_model_formats: model 'reference' cannot export format 'single_file'; it exports: none" in text


class FailingComfyExport:
    model_spec = staticmethod(reference.model_spec)

    @hookimpl
    def export_adapter(self, state_dict, alpha, rank, format):
        if format == "comfyui":
            raise KeyError("no ComfyUI name for 'blocks.0.attn.to_q'")
        if format == "kohya":
            return {f"lora_unet_{k.replace('.', '_', 3)}": v for k, v in state_dict.items()}
        return None


def test_a_format_that_fails_leaves_the_others_and_the_diffusers_file(tmp_path: Path) -> None:
    plugin = registered(FailingComfyExport())
    state = {"blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 8), "blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 4)}
    out = tmp_path / "saved"
    problems = write_adapter(
        out, state, plugin, lora_config(4, 4, 0.0, ["to_q"]), ["diffusers", "comfyui", "kohya"], torch.float32
    )
    assert len(problems) == 1 and "'comfyui' not written: KeyError" in problems[0]
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_model.kohya.safetensors").is_file()
    assert not (out / "adapter_model.comfyui.safetensors").exists()
    assert set(load_file(str(out / "adapter_model.safetensors"))) == {f"transformer.{k}" for k in state}


# ---------------------------------------------------------------------- 5. validate's process counts
def test_validate_names_the_process_counts_a_pipeline_needs(project: Path) -> None:
    (project / "run.toml").write_text(RUN.format(extra="pipeline_stages = 2"))
    ok = CliRunner().invoke(cli, ["validate", "--config", str(project / "run.toml")])
    assert ok.exit_code == 0, ok.output
    assert "train with a multiple of 2 processes (2, 4, 6, 8, ...)" in ok.output
    bad = CliRunner().invoke(cli, ["validate", "--config", str(project / "run.toml"), "--num-procs", "3"])
    assert bad.exit_code == 1 and "pipeline_stages: 2 does not divide the number of processes (3)" in bad.output


# ------------------------------------------------------------------- 6. video plugins and image batches
VIDEO_SPEC = replace(TINY_VIDEO_SPEC, config_schema=reference.ReferenceConfig)


class TinyVideoPlugin(ReferenceTraining):
    """The reference model on videos: every frame goes through its "VAE", and the frames of a latent video
    are stacked along the height for the DiT. Images arrive 4-D and are 1-frame videos."""

    @hookimpl
    def model_spec(self):
        return VIDEO_SPEC

    @hookimpl
    def encode_batch(self, encoders, batch: EncodeBatch):
        if batch.pixels is None:
            return reference.encode_batch(encoders, batch)
        pixels = batch.pixels if batch.pixels.dim() == 5 else batch.pixels.unsqueeze(2)
        return self.encode_video(encoders, pixels, batch.masks)

    def encode_video(self, encoders, pixels: torch.Tensor, masks: torch.Tensor | None):
        b, c, f, h, w = pixels.shape
        frames = pixels.transpose(1, 2).reshape(b * f, c, h, w)
        latents = reference.encode_batch(encoders, EncodeBatch(pixels=frames))["latents"]
        out = {"latents": latents.reshape(b, f, *latents.shape[1:]).transpose(1, 2).contiguous()}
        if masks is not None:
            out["mask"] = F.interpolate(masks.float(), size=latents.shape[-2:], mode="area")
        return out

    @hookimpl
    def prepare_inputs(self, batch, context, generator):
        latents = batch["latents"]
        b, c, f, h, w = latents.shape
        stacked = dict(batch, latents=latents.transpose(2, 3).reshape(b, c, h * f, w))
        if "mask" in batch:
            stacked["mask"] = batch["mask"].repeat(1, 1, f, 1)
        return reference.prepare_inputs(stacked, context, generator)


class VideoOnlyPlugin(TinyVideoPlugin):
    """Assumes every media batch is 5-D, as the third-party author did."""

    @hookimpl
    def encode_batch(self, encoders, batch: EncodeBatch):
        if batch.pixels is None:
            return reference.encode_batch(encoders, batch)
        b, c, f, h, w = batch.pixels.shape
        return self.encode_video(encoders, batch.pixels, batch.masks)


VIDEO = torch.rand(2, 3, 5, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1


def test_the_kit_runs_a_video_plugin_on_image_and_video_batches_with_masks(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "m")
    check_model_plugin(TinyVideoPlugin(), "tinyvideo", {"type": "tinyvideo", "path": tmp_path / "m"}, VIDEO, ["a", "b"])
    with pytest.raises(ValueError, match="not enough values to unpack"):
        check_model_plugin(
            VideoOnlyPlugin(), "tinyvideo", {"type": "tinyvideo", "path": tmp_path / "m"}, VIDEO, ["a", "b"]
        )


# ------------------------------------------------------------- 7. one rank's error, once, last
@pytest.mark.slow
def test_the_failing_ranks_error_is_printed_once_and_last(project: Path) -> None:
    """Stage 1 has no trainable weights, so rank 1 fails while rank 0 waits for it in DeepSpeed's set-up."""
    extra = textwrap.dedent(
        """
        pipeline_stages = 2
        partition_split = [2]
        max_steps = 1
        [adapter]
        rank = 4
        target_modules = ["blocks.0.attn.to_q"]
        """
    )
    (project / "run.toml").write_text(RUN.format(extra=extra))
    result = run_diffpipe(["train", "--config", "run.toml", "--num-procs", "2"], cwd=project, timeout=300)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("diffpipe: worker rank 1 failed: ValueError: pipeline stage 1"), result.output[-3000:]
    assert result.output.count("has no trainable parameters") == 1, result.output[-3000:]
    assert "Traceback" not in result.output and "Connection closed" not in result.output, result.output[-3000:]
