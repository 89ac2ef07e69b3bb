"""The original Lightricks (LTX-2 repository, ComfyUI's ``LTXAVModel``) key layout of the LTX-2 transformer, as a key
table: the inverse of diffusers' ``convert_ltx2_transformer_to_diffusers``.

It differs from diffusers' ``LTX2VideoTransformer3DModel`` only by renames, with no fused tensors: the input
projections (``patchify_proj`` / ``audio_patchify_proj`` = ``proj_in`` / ``audio_proj_in``), the time embeddings
(``adaln_single`` / ``audio_adaln_single`` = ``time_embed`` / ``audio_time_embed``), the global audio-video
cross-attention modulations (``av_ca_*_adaln_single`` = ``av_cross_attn_*``), and in each block the QK norms of its
six attentions (``q_norm`` / ``k_norm`` = ``norm_q`` / ``norm_k``) and the per-block cross-attention tables
(``scale_shift_table_a2v_ca_video`` / ``_audio`` = ``video_`` / ``audio_a2v_cross_attn_scale_shift_table``).
Downloaded checkpoints hold the transformer under ``model.diffusion_model.``, beside the text connectors
(``model.diffusion_model.video_embeddings_connector.*``, ``audio_embeddings_connector.*``, which this table skips:
they load from the folder's ``connectors/``) and other parts (``vae.*``, ``audio_vae.*``, ``vocoder.*``,
``text_embedding_projection.*``, ignored). Loading, per-stage loading, the ``single_file`` export and the ComfyUI LoRA
export read this one table. ComfyUI names every other module as diffusers does (``transformer_blocks.N.attn1.to_q``,
``audio_to_video_attn.to_k``, ``ff.net.0.proj``, ``audio_ff.net.2``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module
from diffpipe_ltx.lightricks import FILE_PREFIX, keys_in_original

ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
#: (original, diffusers) top-level subtrees; the first match wins, so ``audio_adaln_single`` comes first
RENAMES = (
    ("audio_patchify_proj", "audio_proj_in"),
    ("patchify_proj", "proj_in"),
    ("audio_adaln_single", "audio_time_embed"),
    ("adaln_single", "time_embed"),
    ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
    ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
    ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
    ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
    ("audio_prompt_adaln_single", "audio_prompt_adaln"),  # LTX-2.3
    ("prompt_adaln_single", "prompt_adaln"),
)
TABLES = (("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
          ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"))


def layout(num_layers: int) -> KeyTable:
    """The table of an LTX-2 transformer with ``num_layers`` blocks (only the in-block renames depend on it)."""
    norms = tuple(
        Module(f"transformer_blocks.{i}.{a}.{orig}", (f"transformer_blocks.{i}.{a}.{ours}",), params=None)
        for i in range(num_layers)
        for a in ATTENTIONS
        for orig, ours in (("q_norm", "norm_q"), ("k_norm", "norm_k"))
    )
    tables = tuple(
        (f"transformer_blocks.{i}.{orig}", f"transformer_blocks.{i}.{ours}")
        for i in range(num_layers)
        for orig, ours in TABLES
    )
    return KeyTable(
        norms,
        name="original Lightricks",
        model="LTX-2 transformer",
        read_prefixes=(FILE_PREFIX,),
        write_prefix=FILE_PREFIX,
        renames=RENAMES + tables,
        passthrough=True,
        skip=r"^(video|audio)_embeddings_connector\.",
    )


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    return layout(int(config.get("num_layers", 48)))


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The layout for a ComfyUI LoRA: linears differ only by the top-level renames (no block module is renamed)."""
    return layout(0)


def to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers LTX-2 transformer state dict in original key names (without the file prefix)."""
    return keys_in_original(layout, state)


def diffusers_name(name: str, num_layers: int = 0) -> str:
    """An original Lightricks name (without ``model.diffusion_model.``) -> the diffusers name."""
    index = int(name.split(".")[1]) + 1 if name.startswith("transformer_blocks.") else 0
    (target, _), *_ = layout(max(index, num_layers)).targets(name)
    return target


#: where the original checkpoint keeps the text connectors' parts: (original prefixes, diffusers prefix)
PROJECTION = "text_embedding_projection.aggregate_embed"
STREAM_PROJECTION = "text_embedding_projection.{}_aggregate_embed"  # LTX-2.3's feature extractor, one per stream
CONNECTOR_PARTS = (
    ((PROJECTION, FILE_PREFIX + PROJECTION), "text_proj_in"),
    *(((STREAM_PROJECTION.format(s), FILE_PREFIX + STREAM_PROJECTION.format(s)), f"{s}_text_proj_in")
      for s in ("video", "audio")),
    ((f"{FILE_PREFIX}video_embeddings_connector",), "video_connector"),
    ((f"{FILE_PREFIX}audio_embeddings_connector",), "audio_connector"),
)
CONNECTOR_NAMES = (
    ("transformer_blocks.", "transformer_1d_blocks."), (".norm_q.", ".q_norm."), (".norm_k.", ".k_norm.")
)


def connectors_table(config: Mapping[str, Any]) -> KeyTable:
    """The text connectors (diffusers' ``LTX2TextConnectors`` of ``config``) as the original checkpoint holds them:
    ``text_embedding_projection.aggregate_embed`` (LTX-2.3's ``video_aggregate_embed`` / ``audio_aggregate_embed``:
    ``per_modality_projections``; beside the transformer, or under ``model.diffusion_model.``) and
    ``model.diffusion_model.{video,audio}_embeddings_connector`` with ``transformer_1d_blocks`` and ``q_norm`` /
    ``k_norm``: the inverse of diffusers' ``LTX_2_0_CONNECTORS_KEYS_RENAME_DICT``. Every other key of the checkpoint
    is not the connectors'."""
    from accelerate import init_empty_weights
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    with init_empty_weights():
        model = LTX2TextConnectors.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    renames = []
    for key in model.state_dict():
        for originals, ours in CONNECTOR_PARTS:
            if key.startswith(ours + "."):
                rest = key[len(ours) :]
                for a, b in CONNECTOR_NAMES:
                    rest = rest.replace(a, b)
                renames += [(original + rest, key) for original in originals]
    return KeyTable(
        (), name="original Lightricks", model="LTX-2 text connectors", read_prefixes=("",), renames=tuple(renames)
    )
