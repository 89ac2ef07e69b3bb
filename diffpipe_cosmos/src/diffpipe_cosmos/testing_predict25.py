"""Write a tiny random-weight Cosmos-Predict2.5 diffusers folder (``Cosmos2_5_PredictBasePipeline``), for tests,
demos and benchmarks: Predict2's tiny transformer with 2.5's settings (a condition-mask input channel, the
``crossattn_proj`` from the text encoder's concatenated hidden states, RoPE scale 3), Predict2's tiny Wan VAE, a
2-layer Qwen2.5-VL with a byte-level BPE tokenizer carrying Qwen2-VL's chat template (trained in-process: no hub
access), and the ``UniPCMultistepScheduler`` NVIDIA's checkpoints ship (diffusers' converter's settings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffpipe_core.testing import tiny
from diffpipe_cosmos.predict25 import PIPELINE, SYSTEM_PROMPT
from diffpipe_cosmos.testing import WORDS, TinyCosmosConfig, tiny_transformer, tiny_vae

#: the scheduler of NVIDIA's 2.5 folders (diffusers' ``convert_cosmos_to_diffusers.py``)
SCHEDULER = {
    "use_karras_sigmas": True,
    "use_flow_sigmas": True,
    "prediction_type": "flow_prediction",
    "sigma_max": 200.0,
    "sigma_min": 0.01,
}


@dataclass
class TinyPredict25Config(TinyCosmosConfig):
    """Sizes of the tiny Cosmos-Predict2.5: ``qwen_dim`` x ``qwen_layers`` is the text embedding width."""

    qwen_dim: int = 32
    qwen_layers: int = 2


def transformer(cfg: TinyPredict25Config) -> Any:
    """Predict2's tiny ``CosmosTransformer3DModel`` with 2.5's settings."""
    from diffusers import CosmosTransformer3DModel

    base = {k: v for k, v in tiny_transformer(cfg).config.items() if not k.startswith("_")}  # _use_default_values
    return CosmosTransformer3DModel.from_config(
        {
            **base,
            "in_channels": cfg.latent_channels + 1,
            "rope_scale": (1.0, 3.0, 3.0),
            "use_crossattn_projection": True,
            "crossattn_proj_in_channels": cfg.qwen_dim * cfg.qwen_layers,
            "encoder_hidden_states_channels": cfg.text_dim,
        }
    ).eval()


def parts(cfg: TinyPredict25Config) -> dict[str, tiny.Part]:
    """The pipeline's components of ``cfg``, with their seeds."""
    from diffusers import UniPCMultistepScheduler

    tok = tiny.qwen2_vl_tokenizer([SYSTEM_PROMPT, " ".join(WORDS)])
    return {
        "transformer": tiny.Part(lambda: transformer(cfg), seed=cfg.seed),
        "vae": tiny.Part(lambda: tiny_vae(cfg), seed=cfg.seed + 1),
        "text_encoder": tiny.Part(lambda: tiny.qwen25_vl(tok, cfg.qwen_dim, cfg.qwen_layers), seed=cfg.seed + 2),
        "tokenizer": tiny.Part(lambda: tok),
        "scheduler": tiny.Part(lambda: UniPCMultistepScheduler(**SCHEDULER)),
    }


def write_tiny_predict25(folder: Path, cfg: TinyPredict25Config | None = None) -> Path:
    """Save a tiny Cosmos-Predict2.5 diffusers folder at ``folder`` (its components one by one: the pipeline class
    refuses to be built without NVIDIA's guardrail package) with the ``model_index.json`` diffusers writes. Returns
    ``folder``."""
    folder = tiny.write_folder(PIPELINE, parts(cfg or TinyPredict25Config()), Path(folder))
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    index["safety_checker"] = [None, None]
    index_file.write_text(json.dumps(index, indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m diffpipe_cosmos.testing_predict25 FOLDER``: write a tiny Cosmos-Predict2.5 folder."""
    args = tiny.folder_parser(main.__doc__).parse_args(argv)
    print(f"wrote {write_tiny_predict25(args.folder)}")


if __name__ == "__main__":
    main()
