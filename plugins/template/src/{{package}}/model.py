"""A tiny DiT over (frames, height, width) latents, a fixed pooling "VAE" and a byte-level text encoder.

Images are 1-frame videos here: the VAE turns ``(B, 3, H, W)`` images and ``(B, 3, F, H, W)`` videos
alike into ``(B, C, F', H/8, W/8)`` latents (``F' = 1 + (F - 1) / 4``, a causal video VAE's layout).

On disk a model folder holds:
  config.json                 the TinyConfig fields
  transformer.safetensors     the diffusion model
  vae.safetensors             the pixel -> latent projection
  text_encoder.safetensors    the byte embedding text encoder
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

FILES = ("transformer", "vae", "text_encoder")


@dataclass
class TinyConfig:
    in_channels: int = 4
    patch_size: int = 2
    dim: int = 48
    depth: int = 2
    heads: int = 4
    text_dim: int = 32
    text_len: int = 16
    vae_factor: int = 8
    vae_temporal_factor: int = 4


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t in (0, 1) (scaled by 1000, as diffusion models embed timesteps)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    omega = 1.0 / (10000 ** (torch.arange(dim // 2, device=pos.device, dtype=torch.float32) / (dim // 2)))
    angles = pos.float()[:, None] * omega[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def position_embedding(f: int, h: int, w: int, dim: int, device: torch.device) -> torch.Tensor:
    """``(f*h*w, dim)`` fixed sin-cos positions, one part of ``dim`` per axis."""
    part = (dim // 6) * 2
    grid = torch.meshgrid(*(torch.arange(n, device=device) for n in (f, h, w)), indexing="ij")
    sizes = (dim - 2 * part, part, part)
    return torch.cat([_sincos(g.flatten(), size) for g, size in zip(grid, sizes, strict=True)], dim=1)


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


class Block(nn.Module):
    """Joint attention over [text; video] tokens, adaLN-modulated by the conditioning vector."""

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


class Embedder(nn.Module):
    """Latents, t and text -> ``(tokens, c)``: text tokens first, then the patchified latent tokens."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        d, p = config.dim, config.patch_size
        self.dim = d
        self.x_embedder = nn.Conv3d(config.in_channels, d, (1, p, p), stride=(1, p, p))
        self.t_embedder = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.text_proj = nn.Linear(config.text_dim, d)
        self.pooled_proj = nn.Linear(config.text_dim, d)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.x_embedder(x)  # (B, d, f, h, w)
        f, h, w = img.shape[2:]
        img = img.flatten(2).transpose(1, 2) + position_embedding(f, h, w, self.dim, x.device).to(img.dtype)[None]
        c = self.t_embedder(timestep_embedding(t, self.dim).to(img.dtype)) + self.pooled_proj(text.mean(1))
        return torch.cat([self.text_proj(text), img], dim=1), c


class Head(nn.Module):
    """Latent tokens back to a ``(B, C, f, h, w)`` velocity prediction."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        d, p = config.dim, config.patch_size
        self.patch, self.channels, self.text_len = p, config.in_channels, config.text_len
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False)
        self.final_modulation = nn.Linear(d, 2 * d)
        self.proj_out = nn.Linear(d, p * p * config.in_channels)

    def forward(self, tokens: torch.Tensor, c: torch.Tensor, f: int, h: int, w: int) -> torch.Tensor:
        p, ch = self.patch, self.channels
        shift, scale = self.final_modulation(F.silu(c)).unsqueeze(1).chunk(2, dim=-1)
        out = self.proj_out(self.norm_out(tokens[:, self.text_len :]) * (1 + scale) + shift)
        out = out.view(out.shape[0], f, h // p, w // p, p, p, ch).permute(0, 6, 1, 2, 4, 3, 5)
        return out.reshape(out.shape[0], ch, f, h, w)


class TinyDiT(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embedder = Embedder(config)
        self.blocks = nn.ModuleList(Block(config.dim, config.heads) for _ in range(config.depth))
        self.head = Head(config)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        tokens, c = self.embedder(x, t, text)
        for block in self.blocks:
            tokens = block(tokens, c)
        return self.head(tokens, c, *x.shape[2:])


class TinyVAE(nn.Module):
    """A fixed linear "VAE": average-pool space by ``vae_factor`` (and frames after the first by
    ``vae_temporal_factor``), then project 3 -> ``in_channels``."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.factor, self.temporal_factor = config.vae_factor, config.vae_temporal_factor
        self.proj = nn.Conv3d(3, config.in_channels, 1)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dim() == 4:  # images arrive (B, 3, H, W), also in a video model
            pixels = pixels.unsqueeze(2)
        f = self.factor
        latent = F.avg_pool3d(pixels[:, :, :1], (1, f, f))
        if pixels.shape[2] > 1:
            rest = F.avg_pool3d(pixels[:, :, 1:], (self.temporal_factor, f, f))
            latent = torch.cat([latent, rest], dim=2)
        return self.proj(latent)

    def encode_mask(self, masks: torch.Tensor) -> torch.Tensor:
        """``(B, 1, H, W)`` pixel masks (the same for every frame) -> ``(B, 1, 1, h, w)``, which broadcasts
        over the latent frames."""
        return F.avg_pool2d(masks.float(), self.factor).unsqueeze(2)


class ByteTextEncoder(nn.Module):
    """UTF-8 bytes, truncated or padded to ``text_len`` (one length for every caption, so cached
    embeddings stack into batches) -> embeddings -> one linear layer."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.text_len = config.text_len
        self.embed = nn.Embedding(257, config.text_dim)  # 256 = padding
        self.proj = nn.Linear(config.text_dim, config.text_dim)

    def forward(self, captions: list[str]) -> torch.Tensor:
        ids = torch.full((len(captions), self.text_len), 256, dtype=torch.long)
        for i, caption in enumerate(captions):
            data = list(caption.encode("utf-8"))[: self.text_len]
            ids[i, : len(data)] = torch.tensor(data, dtype=torch.long)
        return self.proj(self.embed(ids.to(self.proj.weight.device)))


MODULES: dict[str, type[nn.Module]] = {"transformer": TinyDiT, "vae": TinyVAE, "text_encoder": ByteTextEncoder}


def write_tiny_model(folder: Path | str, config: TinyConfig | None = None, seed: int = 0) -> Path:
    """Write a random-weight model folder in this plugin's on-disk format and return it."""
    config = config or TinyConfig()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    for name, cls in MODULES.items():
        state = {k: v.contiguous() for k, v in cls(config).state_dict().items()}
        save_file(state, str(folder / f"{name}.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(asdict(config), indent=2))
    return folder


def folder_problems(folder: Path) -> list[str]:
    """What is wrong with a model folder's structure (no weights read); [] when it fits."""
    if not folder.is_dir():
        return [f"{folder}: not a folder; expected a model folder holding config.json and {', '.join(FILES)}"]
    problems = [
        f"{folder}: {name}.safetensors is missing; expected {', '.join(f + '.safetensors' for f in FILES)}"
        for name in FILES
        if not (folder / f"{name}.safetensors").is_file()
    ]
    path = folder / "config.json"
    try:
        keys = set(json.loads(path.read_text()))
    except FileNotFoundError:
        return [f"{path}: missing; expected the model's config.json", *problems]
    except (ValueError, AttributeError, TypeError) as exc:
        return [f"{path}: not a JSON object ({exc})", *problems]
    known = {f.name for f in fields(TinyConfig)}
    if keys - known:
        problems.append(f"{path}: unknown keys {sorted(keys - known)}; expected some of {sorted(known)}")
    return problems


def read_config(folder: Path) -> TinyConfig:
    return TinyConfig(**json.loads((folder / "config.json").read_text()))


def load_module(name: str, folder: Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build ``name`` from ``folder``; on the meta device only the skeleton (weights come per stage)."""
    with torch.device("meta"):
        module = MODULES[name](read_config(folder))
    if device.type == "meta":
        return module.to(dtype)
    module = module.to_empty(device=device)
    module.load_state_dict(load_file(str(folder / f"{name}.safetensors"), device=str(device)), strict=True)
    return module.to(dtype)
