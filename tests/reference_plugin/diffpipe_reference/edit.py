"""An edit-pair variant of the reference model (entry point ``reference-edit``, registered by the tests that use it).

Trained like Flux Kontext on the tiny DiT: the target's noisy latents and its control image's clean latents are
concatenated along the token sequence (here: along the latent width, each at its own positions), and the loss
covers the target's tokens only. Items without a control image train as plain text-to-image. Everything but the
spec and the training inputs is the reference model's own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_reference.plugin import (  # noqa: F401  (hook implementations of this plugin too)
    SPEC,
    ReferenceConfig,
    adapter_key_prefix,
    diffusion_model_weights,
    encode_batch,
    load_diffusion_model,
    load_encoders,
    lora_targets,
    split_into_layers,
    validate_model_files,
)

if TYPE_CHECKING:
    import torch

    from diffpipe_core import TrainingContext

EDIT_SPEC = replace(
    SPEC,
    name="reference-edit",
    control_images="optional",
    control_size="target",
    description="The reference model trained on edit pairs (tests)",
)


@hookimpl
def model_spec() -> ModelSpec:
    return EDIT_SPEC


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """``(x, t, text)`` with ``x`` = [noisy target | clean control] along the width when the batch has control
    latents (``control_0_latents``), else the noisy target alone; targets ``(velocity,)`` (and the mask)."""
    import torch

    from diffpipe_core.parts.flow import flow_sample
    from diffpipe_core.types import control_key

    cfg: ReferenceConfig = context.model_config  # type: ignore[assignment]
    s = flow_sample(batch["latents"], cfg, context, generator, time_range=(0.0, 1.0))  # type: ignore[arg-type]
    control = batch.get(control_key(0, "latents"))
    x = s.x_t if control is None else torch.cat([s.x_t, control.float()], dim=-1)
    targets = (s.target, batch["mask"]) if "mask" in batch else (s.target,)
    return (x, s.t, batch["text_embeds"].float()), targets


@hookimpl
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """MSE on the target's tokens only (the first ``width`` latent columns), as Kontext's loss."""
    from diffpipe_core.diffusion import masked_mse

    target = targets[0]
    mask = targets[1] if len(targets) > 1 else None
    return masked_mse(outputs[0][..., : target.shape[-1]], target, mask)
