"""LTX-2's audio stream in training and samples: a clip's waveform to the transformer's packed, normalised audio
latents, and back to a waveform.

Encoding: the waveform ``(B, 2, S)`` at the audio VAE's ``sample_rate`` becomes the log-mel spectrogram the audio
VAE (``AutoencoderKLLTX2Audio``) takes, ``(B, 2, T, mel_bins)``: the magnitude STFT (``n_fft`` 1024, a Hann window
of the same length, hop ``mel_hop_length``, centred with reflect padding) through a Slaney-scale, Slaney-normalised
mel filterbank from 0 to ``sample_rate / 2``, ``log(max(mel, 1e-5))`` (the original LTX-2 audio processor's
settings). The VAE's posterior mode ``(B, C, L, M)`` is cut (or zero-padded) to the latent length ``LTX2Pipeline``
gives a clip of that many frames, packed as ``LTX2Pipeline._pack_audio_latents`` and normalised as
``LTX2Pipeline._normalize_audio_latents`` (the VAE's ``latents_mean`` / ``latents_std`` over the packed features): the
``audio_latents`` the pipeline's transformer denoises. Decoding is the pipeline's: denormalise, unpack, the VAE's
decoder to a mel spectrogram, the vocoder to a waveform at its ``output_sampling_rate``.
"""

from __future__ import annotations

from typing import Any

import torch

N_FFT = 1024  # the original LTX-2 audio processor's STFT size (and window length)


def mel_spectrogram(wave: torch.Tensor, sample_rate: int, hop_length: int, mel_bins: int) -> torch.Tensor:
    """Log-mel spectrogram ``(B, C, T, mel_bins)`` of ``wave`` ``(B, C, S)`` (module docstring), float32."""
    from transformers.audio_utils import mel_filter_bank

    b, c, s = wave.shape
    bank = mel_filter_bank(num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=mel_bins, min_frequency=0.0,
                           max_frequency=sample_rate / 2.0, sampling_rate=sample_rate, norm="slaney",
                           mel_scale="slaney")
    window = torch.hann_window(N_FFT, device=wave.device)
    spec = torch.stft(wave.reshape(b * c, s).float(), N_FFT, hop_length=hop_length, win_length=N_FFT, window=window,
                      center=True, pad_mode="reflect", return_complex=True).abs()  # (B*C, freq, T)
    mel = torch.einsum("fm,nft->nmt", torch.as_tensor(bank, dtype=torch.float32, device=wave.device), spec)
    return torch.log(mel.clamp_min(1e-5)).reshape(b, c, mel_bins, -1).transpose(2, 3).contiguous()


def encode_audio(audio_vae: Any, wave: torch.Tensor, latent_length: int) -> torch.Tensor:
    """The packed, normalised audio latents ``(B, latent_length, C * M)`` of ``wave`` (module docstring)."""
    config = audio_vae.config
    param = next(audio_vae.parameters())
    mel = mel_spectrogram(wave.to(param.device), int(config.sample_rate), int(config.mel_hop_length),
                          int(config.mel_bins))
    with torch.no_grad():
        z = audio_vae.encode(mel.to(param.dtype)).latent_dist.mode().float()  # (B, C, L', M)
    if z.shape[2] >= latent_length:
        z = z[:, :, :latent_length]
    else:
        z = torch.nn.functional.pad(z, (0, 0, 0, latent_length - z.shape[2]))
    packed = z.transpose(1, 2).flatten(2, 3)  # LTX2Pipeline._pack_audio_latents
    mean = audio_vae.latents_mean.to(packed.device, packed.dtype)
    std = audio_vae.latents_std.to(packed.device, packed.dtype)
    return ((packed - mean) / std).cpu()  # LTX2Pipeline._normalize_audio_latents


def decode_audio(audio_vae: Any, vocoder: Any, packed: torch.Tensor, latent_mel: int) -> torch.Tensor:
    """A waveform ``(B, channels, S)`` from packed, normalised audio latents ``(B, L, C * latent_mel)``, as
    ``LTX2Pipeline`` decodes them (denormalise, unpack, the audio VAE's decoder, the vocoder)."""
    param = next(audio_vae.parameters())
    packed = packed.to(param.device, param.dtype)
    latents = packed * audio_vae.latents_std.to(packed) + audio_vae.latents_mean.to(packed)
    latents = latents.unflatten(2, (-1, latent_mel)).transpose(1, 2)  # LTX2Pipeline._unpack_audio_latents
    with torch.no_grad():
        mel = audio_vae.decode(latents, return_dict=False)[0]
        return vocoder(mel.to(next(vocoder.parameters()).dtype)).float()
