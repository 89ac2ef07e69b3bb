"""The reference plugin's hooks as classes, for tests' variants of it: subclass one and override a hook."""

from __future__ import annotations

from diffpipe_reference import plugin as reference


class ReferenceTraining:
    """The reference plugin's training hooks as methods."""

    model_spec = staticmethod(reference.model_spec)
    load_encoders = staticmethod(reference.load_encoders)
    encode_batch = staticmethod(reference.encode_batch)
    load_diffusion_model = staticmethod(reference.load_diffusion_model)
    diffusion_model_weights = staticmethod(reference.diffusion_model_weights)
    split_into_layers = staticmethod(reference.split_into_layers)
    prepare_inputs = staticmethod(reference.prepare_inputs)
    compute_loss = staticmethod(reference.compute_loss)
    lora_targets = staticmethod(reference.lora_targets)


class ReferenceSampling(ReferenceTraining):
    """The reference plugin's training and sampling hooks as methods."""

    denoise_init = staticmethod(reference.denoise_init)
    denoise_inputs = staticmethod(reference.denoise_inputs)
    denoise_step = staticmethod(reference.denoise_step)
    load_decoder = staticmethod(reference.load_decoder)
    decode_latents = staticmethod(reference.decode_latents)
