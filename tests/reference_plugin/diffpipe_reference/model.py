"""A tiny DiT with image latents, a fixed "VAE" and a byte-level text encoder, in plain PyTorch.

On disk (the reference model's real format), a model folder holds:
  config.json                 the TinyDiTConfig fields plus encoder settings
  transformer.safetensors     the diffusion model
  vae.safetensors             the pixel <-> latent projection
  text_encoder.safetensors    the byte embedding text encoder
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn


@dataclass
class TinyDiTConfig:
    in_channels: int = 4
    patch_size: int = 2
    dim: int = 64
    depth: int = 4
    heads: int = 4
    text_dim: int = 32
    text_len: int = 16
    vae_factor: int = 8


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_2d(h: int, w: int, dim: int, device: torch.device) -> torch.Tensor:
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter))
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    out = [f(c.flatten().float()[:, None] * omega[None]) for c in (ys, xs) for f in (torch.sin, torch.cos)]
    return torch.cat(out, dim=1)  # (h*w, dim)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (
            p(x).view(b, n, self.heads, d // self.heads).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class DiTBlock(nn.Module):
    """Joint attention over [text; image] tokens with adaLN modulation from the conditioning vector."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.fc1 = nn.Linear(dim, dim * 2)
        self.fc2 = nn.Linear(dim * 2, dim)
        self.modulation = nn.Linear(dim, 6 * dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        s1, b1, g1, s2, b2, g2 = self.modulation(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        x = x + g1 * self.attn(self.norm1(x) * (1 + s1) + b1)
        return x + g2 * self.fc2(F.gelu(self.fc1(self.norm2(x) * (1 + s2) + b2)))


class TinyDiT(nn.Module):
    def __init__(self, config: TinyDiTConfig) -> None:
        super().__init__()
        self.config = config
        d, p = config.dim, config.patch_size
        self.x_embedder = nn.Conv2d(config.in_channels, d, p, stride=p)
        self.t_embedder = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.text_proj = nn.Linear(config.text_dim, d)
        self.pooled_proj = nn.Linear(config.text_dim, d)
        self.blocks = nn.ModuleList(DiTBlock(d, config.heads) for _ in range(config.depth))
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False)
        self.final_modulation = nn.Linear(d, 2 * d)
        self.proj_out = nn.Linear(d, p * p * config.in_channels)

    # The three pieces below are what split_into_layers wraps; forward() chains them.
    def embed(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor):
        b, _, h, w = x.shape
        p = self.config.patch_size
        img = self.x_embedder(x).flatten(2).transpose(1, 2)
        img = img + sincos_2d(h // p, w // p, self.config.dim, x.device).to(img.dtype)[None]
        txt = self.text_proj(text)
        c = self.t_embedder(timestep_embedding(t, self.config.dim).to(img.dtype)) + self.pooled_proj(text.mean(1))
        tokens = torch.cat([txt, img], dim=1)
        return tokens, c

    def unembed(self, tokens: torch.Tensor, c: torch.Tensor, h: int, w: int) -> torch.Tensor:
        p, ch = self.config.patch_size, self.config.in_channels
        shift, scale = self.final_modulation(F.silu(c)).unsqueeze(1).chunk(2, dim=-1)
        img = self.proj_out(self.norm_out(tokens[:, self.config.text_len :]) * (1 + scale) + shift)
        b = img.shape[0]
        img = img.view(b, h // p, w // p, p, p, ch).permute(0, 5, 1, 3, 2, 4)
        return img.reshape(b, ch, h, w)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        tokens, c = self.embed(x, t, text)
        for block in self.blocks:
            tokens = block(tokens, c)
        return self.unembed(tokens, c, x.shape[2], x.shape[3])


class TinyVAE(nn.Module):
    """A fixed linear "VAE": average-pool by ``factor`` and project 3 -> in_channels."""

    def __init__(self, config: TinyDiTConfig) -> None:
        super().__init__()
        self.factor = config.vae_factor
        self.proj = nn.Conv2d(3, config.in_channels, 1)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(F.avg_pool2d(pixels, self.factor))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1]: the least-squares inverse of the projection, upsampled by ``factor`` (what the
        average pooling removed does not come back)."""
        weight = self.proj.weight[:, :, 0, 0].float()  # (in_channels, 3)
        centred = latents.float() - self.proj.bias.float().view(1, -1, 1, 1)
        pixels = torch.einsum("pc,bchw->bphw", torch.linalg.pinv(weight), centred)
        return F.interpolate(pixels, scale_factor=self.factor, mode="nearest").clamp(-1, 1)


class ByteTextEncoder(nn.Module):
    """UTF-8 bytes (truncated/padded to ``text_len``) -> embeddings -> one linear layer."""

    def __init__(self, config: TinyDiTConfig) -> None:
        super().__init__()
        self.text_len = config.text_len
        self.embed = nn.Embedding(257, config.text_dim)  # 256 = padding
        self.proj = nn.Linear(config.text_dim, config.text_dim)

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        ids = torch.full((len(captions), self.text_len), 256, dtype=torch.long)
        for i, caption in enumerate(captions):
            data = list(caption.encode("utf-8"))[: self.text_len]
            ids[i, : len(data)] = torch.tensor(data, dtype=torch.long)
        return ids

    def forward(self, captions: list[str]) -> torch.Tensor:
        return self.proj(self.embed(self.tokenize(captions).to(self.proj.weight.device)))


def write_tiny_model(folder: Path | str, config: TinyDiTConfig | None = None, seed: int = 0) -> Path:
    """Write a random-weight reference model folder (the real on-disk format) and return it."""
    config = config or TinyDiTConfig()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    for name, module in (
        ("transformer", TinyDiT(config)),
        ("vae", TinyVAE(config)),
        ("text_encoder", ByteTextEncoder(config)),
    ):
        state = {k: v.contiguous() for k, v in module.state_dict().items()}
        save_file(state, str(folder / f"{name}.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(asdict(config), indent=2))
    return folder


def read_config(folder: Path) -> TinyDiTConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a reference model folder (config.json missing)")
    return TinyDiTConfig(**json.loads(path.read_text()))


def load_module(cls: type[nn.Module], folder: Path, name: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    config = read_config(folder)
    with torch.device("meta"):
        module = cls(config)
    if device.type == "meta":
        return module.to(dtype)
    module = module.to_empty(device=device)
    module.load_state_dict(load_file(str(folder / f"{name}.safetensors"), device=str(device)), strict=True)
    return module.to(dtype)
