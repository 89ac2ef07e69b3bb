"""Samples during training and ``diffpipe sample``: done once in the core for every model plugin that
provides the denoising hooks (``denoise_init``, ``denoise_inputs``, ``denoise_step``, ``load_decoder``,
``decode_latents``; optionally ``combine_guidance``).

- :mod:`.config`: the ``[sample]`` table and the default size from the dataset TOML (no torch).
- :mod:`.schedules`: flow-matching sigma schedules and the Euler step plugins call.
- :mod:`.loop`: the denoising loop with classifier-free guidance, over any forward function.
- :mod:`.pipeline`: forward passes through a ``PipelineEngine`` (or a plain layer chain).
- :mod:`.prompts`: encode the prompts once with the plugin's text encoders.
- :mod:`.decoder`: the decoder, loaded once on rank 0, on the device only while decoding.
- :mod:`.output`: PNG / MP4 (PyAV) files and :func:`.output.log_sampling_point`, the one hand-over to loggers.
- :mod:`.contact_sheet`: one grid picture per sampling point, the prompt under each sample.
- :mod:`.runner`: when to sample during training, data-parallel sharing, gathering, writing one point.
- :mod:`.worker`: the worker's side: a training run's sampler, or ``diffpipe sample``'s forward-only engine.
- :mod:`.command`: the ``diffpipe sample`` command.
"""
