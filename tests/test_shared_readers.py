"""The file readers and test builders the model plugins share: a diffusers folder's weight files, a saved full
fine-tune's shards read back, and the tiny word-level tokenizers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffpipe_core.engine.saving import SAVED_INDEX, read_saved_model, write_model_shards
from diffpipe_core.model_files import diffusers_weight_files
from diffpipe_core.testing.tokenizers import word_level_tokenizer


def test_diffusers_weight_files_single_sharded_and_missing(tmp_path: Path) -> None:
    folder = tmp_path / "transformer"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=r"transformer: no diffusion_pytorch_model\.safetensors.*; give x"):
        diffusers_weight_files(folder, "give x")
    save_file({"a": torch.zeros(1)}, folder / "diffusion_pytorch_model.safetensors")
    assert diffusers_weight_files(folder) == [folder / "diffusion_pytorch_model.safetensors"]

    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    shards = {
        "b": "m-00002-of-00002.safetensors",
        "a": "m-00001-of-00002.safetensors",
        "c": "m-00001-of-00002.safetensors",
    }
    index.write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    assert diffusers_weight_files(folder) == [
        folder / "m-00001-of-00002.safetensors",
        folder / "m-00002-of-00002.safetensors",
    ]
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="index.json: no weight_map"):
        diffusers_weight_files(folder)


def test_diffusers_weight_files_fall_back_to_the_fp16_variant(tmp_path: Path) -> None:
    """Some hub downloads hold only ``diffusion_pytorch_model.fp16.safetensors``; the plain file wins when both are
    there, and a folder with neither is named with what was looked for."""
    folder = tmp_path / "unet"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=r"unet: no UNet weights \(diffusion_pytorch_model\.safetensors, its "):
        diffusers_weight_files(folder, what="UNet weights")
    save_file({"a": torch.zeros(1)}, folder / "diffusion_pytorch_model.fp16.safetensors")
    assert diffusers_weight_files(folder) == [folder / "diffusion_pytorch_model.fp16.safetensors"]
    save_file({"a": torch.zeros(1)}, folder / "diffusion_pytorch_model.safetensors")
    assert diffusers_weight_files(folder) == [folder / "diffusion_pytorch_model.safetensors"]


def test_read_saved_model_reads_back_what_write_model_shards_wrote(tmp_path: Path) -> None:
    halves = [{"x.weight": torch.randn(3, 2)}, {"y.weight": torch.randn(4), "y.bias": torch.randn(1)}]
    saved = tmp_path / "saved"
    barrier = threading.Barrier(2)
    kw = {"dp_rank": 0, "num_stages": 2, "dtype": torch.float32, "barrier": barrier.wait}
    threads = [
        threading.Thread(target=write_model_shards, args=(saved, halves[r]), kwargs={**kw, "rank": r, "stage_id": r})
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    state = read_saved_model(saved)
    assert sorted(state) == ["x.weight", "y.bias", "y.weight"]
    for half in halves:
        for key, value in half.items():
            assert torch.equal(state[key], value)

    (saved / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors: not found; .*index\.json"):
        read_saved_model(saved)
    (saved / SAVED_INDEX).unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json: not found"):
        read_saved_model(saved)


def test_word_level_tokenizer_round_trips_through_auto_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    specials = ["<pad>", "</s>", "<unk>", "<s>"]
    tok = word_level_tokenizer(
        ["cat", "dog", "a"], specials, "<s> $A </s>", 8, pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    # specials first (ids 0..3), then the sorted words; lowercased; unknown words -> <unk>
    assert back("A Dog zebra", padding="max_length", max_length=8)["input_ids"] == [3, 4, 6, 2, 1, 0, 0, 0]
    assert (back.pad_token_id, back.eos_token_id, back.bos_token_id, back.model_max_length) == (0, 1, 3, 8)
