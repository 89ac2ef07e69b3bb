"""Samples during training and ``diffpipe sample``: done once in the core for every model plugin that
provides the denoising hooks (``denoise_init``, ``denoise_inputs``, ``denoise_step``, ``load_decoder``,
``decode_latents``).

- :mod:`.config`: the ``[sample]`` table (no torch).
- :mod:`.schedules`: flow-matching sigma schedules and the Euler step plugins call.
- :mod:`.loop`: the denoising loop with classifier-free guidance, over any forward function.
- :mod:`.pipeline`: forward passes through the training ``PipelineEngine`` (or a plain layer chain).
- :mod:`.prompts`: encode the prompts once with the plugin's text encoders.
- :mod:`.output`: PNG / MP4 (PyAV) files and TensorBoard images.
- :mod:`.runner`: when to sample during training, data-parallel sharing, decoding on one rank.
- :mod:`.command`: the ``diffpipe sample`` command.
"""
