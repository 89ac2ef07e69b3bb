"""``DiffusersFolder(text_encoders=...)``: a text encoder component not named ``text_encoder*`` (OmniGen2's ``mllm``)
is one a ``[model] text_encoders`` file may give; tokenizers never are (the component files themselves are loaded in
plugins/diffpipe_omnigen/tests/test_omnigen_component_files.py)."""

from __future__ import annotations

from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder

COMPONENTS = {"transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL",
              "mllm": "Qwen2_5_VLForConditionalGeneration", "processor": TOKENIZER, "text_encoder": "T5EncoderModel"}


def test_named_text_encoders_join_the_text_encoder_components() -> None:
    plain = DiffusersFolder("m", ("P",), COMPONENTS)
    assert plain.text_encoder_names() == ["text_encoder"]
    named = DiffusersFolder("m", ("P",), COMPONENTS, text_encoders=("mllm", "processor"))
    assert named.text_encoder_names() == ["mllm", "text_encoder"]  # the tokenizer stays out
