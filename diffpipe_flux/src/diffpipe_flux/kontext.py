"""FLUX.1 Kontext [dev] (entry point ``flux-kontext``): Flux trained on edit pairs, as ``FluxKontextPipeline`` runs it.

A control image's latents (cached through Flux's own ``encode_batch``, normalised like the target's) are packed 2x2
and appended to the noisy target's tokens, with position ids whose first axis is 1 instead of 0; the transformer
predicts for all tokens and the loss covers the target's tokens only. Items without a control image train as plain
text-to-image in their own micro-batches. Everything else (loading, layouts, exports) is Flux's. This module imports
no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_flux.config import FluxKontextConfig
from diffpipe_flux.plugin import COMPONENTS, PIPELINES, Flux

if TYPE_CHECKING:
    import torch

    from diffpipe_core import TrainingContext


class FluxKontext(Flux):
    """Flux Kontext: a Flux transformer conditioned on a control image appended along the token sequence."""
    tiny_writer = "diffpipe_flux.testing:write_tiny_flux"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        Flux.spec,
        name="flux-kontext",
        config_schema=FluxKontextConfig,
        control_images="optional",
        control_size="target",
        description="FLUX.1 Kontext [dev] edit pairs (diffusers folder, or the BFL single file over a Flux folder)",
    )
    folder = DiffusersFolder(
        "flux-kontext", ("FluxKontextPipeline", *PIPELINES), COMPONENTS, single_file_example="flux1-kontext-dev"
    )

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """Flux's inputs for the target, with the control image's packed tokens appended to ``x_t`` and its ids
        (first axis 1) to the image ids, as ``FluxKontextPipeline.prepare_latents`` builds them."""
        import torch

        from diffpipe_core.types import control_key
        from diffpipe_flux.packing import image_ids, pack

        inputs, targets = super().prepare_inputs(batch, context, generator)
        control = batch.get(control_key(0, "latents"))
        if control is None:
            return inputs, targets
        x, t, text, pooled, guidance, ids, txt_ids = inputs
        control_ids = image_ids(*control.shape[-2:])
        control_ids[:, 0] = 1
        x = torch.cat([x, pack(control.float())], dim=1)
        return (x, t, text, pooled, guidance, torch.cat([ids, control_ids]), txt_ids), targets

    @hookimpl
    def compute_loss(
        self, outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...], context: TrainingContext
    ) -> torch.Tensor:
        """The loss on the target's tokens only (the prediction's first ``len(target)`` tokens), mask-weighted."""
        from diffpipe_core.parts.flow import flow_loss, leading_tokens

        return flow_loss(leading_tokens(outputs, targets), targets, context)

    @hookimpl
    def denoise_inputs(self, latents, schedule, index, text, request, model_config):
        """Flux's inputs with the prompt's control image (``[sample] control_images``) appended, as in training."""
        import torch

        from diffpipe_core.types import control_key
        from diffpipe_flux.packing import image_ids, pack

        inputs = super().denoise_inputs(latents, schedule, index, text, request, model_config)
        control = text.get(control_key(0, "latents"))
        if control is None:
            return inputs
        x, t, t5, pooled, guidance, ids, txt_ids = inputs
        control_ids = image_ids(*control.shape[-2:])
        control_ids[:, 0] = 1
        x = torch.cat([x, pack(control.float().expand(x.shape[0], -1, -1, -1))], dim=1)
        return x, t, t5, pooled, guidance, torch.cat([ids, control_ids]), txt_ids

    def unpack_prediction(self, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The prediction for the target's tokens (the control's come after them), unpacked."""
        n = (latents.shape[-2] // 2) * (latents.shape[-1] // 2)
        return super().unpack_prediction(prediction[:, :n], latents)


plugin = FluxKontext()
