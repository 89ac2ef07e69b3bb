"""``DiffusersFolder.component_class``: for a component of ``by_index``, the class the folder's ``model_index.json``
(or a modular pipeline's ``modular_model_index.json``) names is the one built, if accepted; the table's first
otherwise (no folder, a class it does not accept, a config-only folder without an index, a component not in
``by_index``, whose accepted classes only widen what validation takes). The loading
through it is tested by the plugins whose releases differ in a class (diffpipe_ltx/tests/test_ltx23.py: LTX-2.5's
Gemma 4)."""

from __future__ import annotations

import json
from pathlib import Path

from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder

COMPONENTS = {"transformer": "FluxTransformer2DModel", "tokenizer": TOKENIZER,
              "text_encoder": ("Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration")}


def _index(folder: Path, name: str, text_encoder: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    entry = ["transformers", text_encoder] + ([{"subfolder": "text_encoder"}] if name.startswith("modular") else [])
    (folder / name).write_text(json.dumps({"_class_name": "P", "text_encoder": entry}))
    return folder


def test_the_class_the_folders_index_names_is_built_when_accepted(tmp_path: Path) -> None:
    fixed = DiffusersFolder("m", ("P",), COMPONENTS)
    folder = DiffusersFolder("m", ("P",), COMPONENTS, by_index=("text_encoder",))
    assert folder.component_class("text_encoder") == "Gemma3ForConditionalGeneration"
    plain = _index(tmp_path / "plain", "model_index.json", "Gemma4ForConditionalGeneration")
    assert folder.component_class("text_encoder", plain) == "Gemma4ForConditionalGeneration"
    modular = _index(tmp_path / "modular", "modular_model_index.json", "Gemma4ForConditionalGeneration")
    assert folder.component_class("text_encoder", modular) == "Gemma4ForConditionalGeneration"
    other = _index(tmp_path / "other", "model_index.json", "T5EncoderModel")  # not accepted: validation names it
    assert folder.component_class("text_encoder", other) == "Gemma3ForConditionalGeneration"
    assert folder.component_class("text_encoder", tmp_path / "configs-only") == "Gemma3ForConditionalGeneration"
    assert folder.component_class("transformer", plain) == "FluxTransformer2DModel"
    assert fixed.component_class("text_encoder", plain) == "Gemma3ForConditionalGeneration"
