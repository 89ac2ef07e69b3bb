"""The decoder (VAE) of the rank that decodes samples: loaded once per run into host memory, on the device only
while it decodes.

``load_decoder`` is called once, with the host as its device; the core finds the ``nn.Module`` s in what it
returned (the object itself, or inside a tuple, list, dict or the object's attributes) and moves them onto the
device for each sampling point's decoding and back to host memory right after, so the accelerator holds the
decoder only while it decodes. A decoder object without modules cannot be moved: it is loaded onto the
device at each sampling point and dropped after. On a CPU-only run host and device are one, nothing moves.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from diffpipe_core.registry import ModelPlugin
from diffpipe_core.types import ModelConfigBase

HOST = torch.device("cpu")


def find_modules(obj: Any, depth: int = 2) -> list[nn.Module]:
    """The top-level ``nn.Module`` s in ``obj``: itself, or in its tuple/list/dict items or attributes, looked for
    ``depth`` levels down (each module once)."""
    found: dict[int, nn.Module] = {}

    def visit(x: Any, level: int) -> None:
        if isinstance(x, nn.Module):
            found.setdefault(id(x), x)
            return
        if level <= 0 or x is None or isinstance(x, (str, bytes, int, float, bool, torch.Tensor)):
            return
        if isinstance(x, dict):
            children = list(x.values())
        elif isinstance(x, (tuple, list)):
            children = list(x)
        elif hasattr(x, "__dict__"):
            children = list(vars(x).values())
        else:
            return
        for child in children:
            visit(child, level - 1)

    visit(obj, depth)
    return list(found.values())


class HeldDecoder:
    """Decodes final latents with the plugin's hooks; :meth:`close` frees the decoder."""

    def __init__(self, plugin: ModelPlugin, model_config: ModelConfigBase, device: torch.device) -> None:
        self.plugin, self.model_config, self.device = plugin, model_config, device
        self._held: Any = None  # the decoder, in host memory between sampling points
        self._modules: list[nn.Module] = []
        self.loads = 0

    def _load(self, device: torch.device) -> Any:
        self.loads += 1
        return self.plugin.require("load_decoder", model_config=self.model_config, device=device)

    def session(self) -> _Session:
        """``with decoder.session() as decode: pixels = decode(latents)``: the decoder is on the device inside the
        block; ``decode`` returns one sample's pixels (float32, on the CPU, batch dimension dropped), and
        ``decode.audio(latents)`` its sound where the model makes one (``decode_audio``)."""
        return _Session(self)

    def _acquire(self) -> Any:
        if self.device.type == HOST.type:
            if self._held is None:
                self._held = self._load(HOST)
            return self._held
        if self._held is None and self.loads == 0:
            self._held = self._load(HOST)
            self._modules = find_modules(self._held)
            if not self._modules:  # nothing to move: load it on the device at every sampling point
                self._held = None
        if self._held is None:
            return self._load(self.device)
        for module in self._modules:
            module.to(self.device)
        return self._held

    def _release(self, decoder: Any) -> None:
        if self.device.type == HOST.type:
            return
        if decoder is self._held:
            for module in self._modules:
                module.to(HOST)
        del decoder
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._held, self._modules = None, []
        gc.collect()


class _Session:
    def __init__(self, owner: HeldDecoder) -> None:
        self.owner = owner
        self.decoder: Any = None

    def __enter__(self):
        self.decoder = self.owner._acquire()
        plugin, device = self.owner.plugin, self.owner.device

        decoder = self.decoder

        class Decode:
            """``decode(latents)``: one sample's pixels; ``decode.audio(latents)``: its sound (``decode_audio``) as
            ``((channels, S) float32 on the CPU, sample rate)``, or None."""

            def __call__(self, latents: torch.Tensor) -> torch.Tensor:
                with torch.no_grad():
                    pixels = plugin.require("decode_latents", decoder=decoder, latents=latents.to(device))
                return pixels[0].float().cpu()

            def audio(self, latents: torch.Tensor) -> tuple[torch.Tensor, int] | None:
                with torch.no_grad():
                    sound = plugin.call("decode_audio", decoder=decoder, latents=latents.to(device))
                return None if sound is None else (sound[0][0].float().cpu(), int(sound[1]))

        return Decode()

    def __exit__(self, *exc: object) -> None:
        decoder, self.decoder = self.decoder, None
        self.owner._release(decoder)
