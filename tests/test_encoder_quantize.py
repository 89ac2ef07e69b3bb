"""``[model] encoder_quantize``: the text encoders of a model folder loaded through bitsandbytes while caching
(:func:`diffpipe_core.parts.encoders.load_components`): a tiny Llama text encoder folder loads with ``Linear4bit`` /
``Linear8bitLt`` linears, in fewer bytes, its caption hidden states close to the unquantized ones; the caption
cache key changes with the key (and not for runs without it); a bad value, missing bitsandbytes and a text encoder
given as a file are refused naming the key."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import bitsandbytes as bnb  # a core dependency: its absence fails these tests, not skips them
import pytest
import torch
from pydantic import ValidationError

from diffpipe_core.data.cache_keys import encoder_fingerprint, encoder_identity
from diffpipe_core.parts.config import DiffusersModelConfig
from diffpipe_core.parts.encoders import load_components, quantization_config
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_core.testing import tiny
from diffpipe_core.testing.quantized import nf4_round_trip

FOLDER = DiffusersFolder("Tiny", ("TinyPipeline",), {"vae": "AutoencoderKL", "text_encoder": "LlamaModel",
                                                    "tokenizer": TOKENIZER})
CPU = torch.device("cpu")
CAPTIONS = ["a photo of a red cat", "a small dog in the city with a blue car"]
SETTINGS = ("path", "encoder_dtype")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a tiny Llama text encoder (width 128: linears of 16-32 k weights, as bitsandbytes blocks
    them) and its tokenizer, as ``save_pretrained`` writes them."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("quantize")
    tokenizer = tiny.t5_tokenizer()
    tiny.llama(tokenizer, dim=128, layers=2).save_pretrained(str(root / "text_encoder"))
    tokenizer.save_pretrained(str(root / "tokenizer"))
    return root


def config(folder: Path, **keys: object) -> DiffusersModelConfig:
    return DiffusersModelConfig(type="tiny", path=folder, encoder_dtype="bfloat16", **keys)


def hidden(encoders: object) -> torch.Tensor:
    tokens = encoders.tokenizer(CAPTIONS, padding=True, return_tensors="pt")  # type: ignore[attr-defined]
    with torch.no_grad():
        out = encoders.text_encoder(**tokens).last_hidden_state  # type: ignore[attr-defined]
    return out.float()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.fixture(scope="module")
def full(folder: Path) -> tuple[int, torch.Tensor, Any]:
    """The bf16 encoder's parameter bytes, its caption hidden states, and the encoder."""
    enc = load_components(FOLDER, config(folder), CPU, "text_encoder", "tokenizer")
    assert type(enc.text_encoder.layers[0].self_attn.q_proj) is torch.nn.Linear
    return weight_bytes(enc.text_encoder), hidden(enc), enc


@pytest.mark.parametrize(("mode", "linear", "share"), [("nf4", "Linear4bit", 0.45), ("int8", "Linear8bitLt", 0.7)])
def test_text_encoders_load_quantized_close_to_the_full_ones(
    folder: Path, full: tuple[int, torch.Tensor, Any], mode: str, linear: str, share: float
) -> None:
    """Every linear of the decoder layers is a frozen bitsandbytes one; the parameter bytes drop (bf16 -> 4 or 8 bits
    for the linears; the embedding table stays bf16, hence the shares). The captions' hidden states: nf4's equal
    those of the bf16 encoder with nf4 round-tripped weights (so the quantization is bitsandbytes' own, applied to
    every layer), and differ from the bf16 encoder's by under 25 % of their norm (this random Llama's weights err
    by about 9 % each under nf4's 16 levels per block, compounded over two layers: 15 % measured); int8's
    (row-wise, 256 levels) by under 5 %."""
    full_bytes, want, bf16 = full
    enc = load_components(FOLDER, config(folder, encoder_quantize=mode), CPU, "text_encoder", "tokenizer")
    layers = enc.text_encoder.layers
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        assert isinstance(layers[1].get_submodule(name), getattr(bnb.nn, linear)), name
    assert not any(p.requires_grad for p in enc.text_encoder.parameters())
    assert weight_bytes(enc.text_encoder) < share * full_bytes, (weight_bytes(enc.text_encoder), full_bytes)
    got = hidden(enc)
    if mode == "nf4":  # bitsandbytes' own quantization of every linear of the layers, nothing else changed
        reference = copy.deepcopy(bf16)
        assert nf4_round_trip(reference.text_encoder, enc.text_encoder) == 7 * len(layers)
        torch.testing.assert_close(got, hidden(reference), rtol=1e-2, atol=1e-2)
    error = float((got - want).norm() / want.norm())
    assert 0 < error < (0.25 if mode == "nf4" else 0.05), error


def test_the_caption_cache_key_changes_with_encoder_quantize(folder: Path) -> None:
    """nf4, int8 and none key three caches; a run without the key keeps the key it had before the key existed."""
    keys = {mode: encoder_fingerprint("tiny", "1", config(folder, encoder_quantize=mode), SETTINGS)
            for mode in ("nf4", "int8", None)}
    assert len(set(keys.values())) == 3
    assert "encoder_quantize" not in encoder_identity(config(folder), SETTINGS)


def test_bad_values_and_missing_bitsandbytes_are_refused_by_name(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValidationError, match="encoder_quantize"):
        config(folder, encoder_quantize="fp4")
    with pytest.raises(ValueError, match=r"encoder_quantize: unknown mode 'fp4'; valid: nf4, int8"):
        quantization_config("fp4", torch.bfloat16)
    # A text encoder given as a file: bitsandbytes quantizes the folder's weights as they are read.
    from transformers import LlamaModel

    file = tiny.save_single_file(LlamaModel.from_pretrained(str(folder / "text_encoder")).state_dict(),
                                 tmp_path / "llama.safetensors")
    with pytest.raises(ValueError, match=r"encoder_quantize = 'nf4'.*text_encoders gives text_encoder as a file"):
        load_components(FOLDER, config(folder, encoder_quantize="nf4", text_encoders=(file,)), CPU, "text_encoder")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else found(name))
    with pytest.raises(ValueError, match=r"encoder_quantize = 'int8' needs the bitsandbytes package"):
        load_components(FOLDER, config(folder, encoder_quantize="int8"), CPU, "text_encoder", "tokenizer")
