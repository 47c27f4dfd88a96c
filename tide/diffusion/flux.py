"""FLUX.1: a flow-matching DiT denoiser, CLIP-L (pooled) + T5 (sequence) text encoders, guidance
embedding, latents packed into 2x2 patches.

Guidance: `guidance_scale` is the distilled guidance the transformer embeds (one forward per step). A
`negative_prompt` means true classifier-free guidance and needs `true_cfg_scale > 1` (then each step
also predicts for the negative prompt, in the same forward, and mixes `neg + true_cfg_scale * (pos -
neg)`); a negative prompt without it, or `true_cfg_scale > 1` without one, is refused rather than
ignored.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from tide.diffusion.io_struct import DiffusionBatch, ImageRequest
from tide.diffusion.stages import (
    DecodingStage,
    InputValidationStage,
    Stage,
    initial_noise,
    repeat_per_image,
    tokenize,
)

COMPONENTS: dict[str, tuple[str, ...]] = {
    "scheduler": ("FlowMatchEulerDiscreteScheduler",),
    "text_encoder": ("CLIPTextModel",),
    "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
    "text_encoder_2": ("T5EncoderModel",),
    "tokenizer_2": ("T5TokenizerFast", "T5Tokenizer"),
    "transformer": ("FluxTransformer2DModel",),
    "vae": ("AutoencoderKL",),
}
DEFAULT_GUIDANCE_SCALE = 3.5


def vae_scale_factor(vae: Any) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


class FluxInputValidation(InputValidationStage):
    def check_guidance(self, req: ImageRequest) -> None:
        if req.negative_prompts is not None and req.true_cfg_scale <= 1.0:
            raise ValueError("negative_prompt: FLUX uses a negative prompt only for true classifier-free "
                             "guidance; pass true_cfg_scale > 1 with it")
        if req.negative_prompts is None and req.true_cfg_scale > 1.0:
            raise ValueError("true_cfg_scale > 1 needs a negative_prompt")

    def uses_cfg(self, req: ImageRequest) -> bool:
        return req.negative_prompts is not None


class FluxTextEncoding(Stage):
    """Pooled CLIP embedding and T5 sequence embedding of every prompt (and negative prompt)."""

    name = "text_encoding"
    components = ("text_encoder", "text_encoder_2")

    def __init__(self, tokenizer: Any, text_encoder: Any, tokenizer_2: Any, text_encoder_2: Any,
                 max_sequence_length: int, device: torch.device) -> None:
        self.tokenizer, self.text_encoder = tokenizer, text_encoder
        self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2
        self.clip_length = min(tokenizer.model_max_length,
                               text_encoder.config.max_position_embeddings)
        self.max_sequence_length = max_sequence_length
        self.device = device

    def __call__(self, batch: DiffusionBatch) -> None:
        texts = list(batch.prompts)
        if batch.do_cfg:
            texts += [p if p is not None else "" for p in batch.negative_prompts]
        clip_ids = tokenize(self.tokenizer, texts, self.clip_length).to(self.device)
        pooled = self.text_encoder(clip_ids, output_hidden_states=False).pooler_output
        pooled = pooled.to(self.text_encoder.dtype)
        t5_ids = tokenize(self.tokenizer_2, texts, self.max_sequence_length).to(self.device)
        embeds = self.text_encoder_2(t5_ids, output_hidden_states=False)[0]
        embeds = embeds.to(self.text_encoder_2.dtype)
        n = len(batch.prompts)
        batch.prompt_embeds = repeat_per_image(embeds[:n], batch.repeats)
        batch.pooled_prompt_embeds = repeat_per_image(pooled[:n], batch.repeats)
        if batch.do_cfg:
            batch.negative_prompt_embeds = repeat_per_image(embeds[n:], batch.repeats)
            batch.negative_pooled_prompt_embeds = repeat_per_image(pooled[n:], batch.repeats)
        batch.text_ids = torch.zeros(embeds.shape[1], 3, device=self.device,
                                     dtype=self.text_encoder.dtype)


def image_seq_len(height: int, width: int, vae_factor: int) -> int:
    """Packed latent tokens of an image: one per 2x2 patch of the latent grid."""
    return (height // (vae_factor * 2)) * (width // (vae_factor * 2))


def resolution_shift(seq_len: int, scheduler_config: Any) -> float:
    """`mu` of the dynamic timestep shift: linear in the image's token count between
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    x0 = scheduler_config.get("base_image_seq_len", 256)
    x1 = scheduler_config.get("max_image_seq_len", 4096)
    y0 = scheduler_config.get("base_shift", 0.5)
    y1 = scheduler_config.get("max_shift", 1.15)
    slope = (y1 - y0) / (x1 - x0)
    return seq_len * slope + (y0 - slope * x0)


class FluxTimestepPreparation(Stage):
    """A batch-owned copy of the flow-matching scheduler, set to `num_inference_steps` sigmas from 1
    down to 1/steps, shifted for the image size."""

    name = "timestep_preparation"

    def __init__(self, scheduler: Any, vae_factor: int, device: torch.device) -> None:
        self.scheduler = scheduler
        self.vae_factor = vae_factor
        self.device = device

    def __call__(self, batch: DiffusionBatch) -> None:
        scheduler = copy.deepcopy(self.scheduler)
        steps = batch.num_inference_steps
        mu = resolution_shift(image_seq_len(batch.height, batch.width, self.vae_factor),
                              scheduler.config)
        if scheduler.config.get("use_flow_sigmas", False):
            scheduler.set_timesteps(steps, device=self.device, mu=mu)
        else:
            sigmas = np.linspace(1.0, 1 / steps, steps)
            scheduler.set_timesteps(sigmas=sigmas, device=self.device, mu=mu)
        scheduler.set_begin_index(0)
        batch.scheduler = scheduler
        batch.timesteps = scheduler.timesteps


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): each 2x2 latent patch becomes one token."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack_latents` for a latent grid of h x w."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def latent_grid(height: int, width: int, vae_factor: int) -> tuple[int, int]:
    """Latent height and width (even, for the 2x2 packing)."""
    return 2 * (height // (vae_factor * 2)), 2 * (width // (vae_factor * 2))


class FluxLatentPreparation(Stage):
    """Seeded Gaussian noise on the latent grid, packed into tokens, and the tokens' (0, row, col)
    position ids."""

    name = "latent_preparation"

    def __init__(self, in_channels: int, vae_factor: int, device: torch.device) -> None:
        self.channels = in_channels // 4
        self.vae_factor = vae_factor
        self.device = device

    def __call__(self, batch: DiffusionBatch) -> None:
        h, w = latent_grid(batch.height, batch.width, self.vae_factor)
        dtype = batch.prompt_embeds.dtype
        noise = initial_noise(batch, (self.channels, h, w), self.device, dtype)
        batch.latents = pack_latents(noise)
        rows = torch.arange(h // 2).repeat_interleave(w // 2)
        cols = torch.arange(w // 2).repeat(h // 2)
        ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1)
        batch.latent_image_ids = ids.to(device=self.device, dtype=dtype)


class FluxDenoising(Stage):
    """The flow-matching loop: the transformer predicts a velocity, the scheduler takes an Euler step.
    With true CFG the positive and negative predictions share one forward of twice the batch."""

    name = "denoising"
    components = ("transformer",)

    def __init__(self, transformer: Any, device: torch.device) -> None:
        self.transformer = transformer
        self.device = device

    def __call__(self, batch: DiffusionBatch) -> None:
        latents = batch.latents
        embeds, pooled = batch.prompt_embeds, batch.pooled_prompt_embeds
        rows = latents.shape[0] * (2 if batch.do_cfg else 1)
        if batch.do_cfg:
            embeds = torch.cat([embeds, batch.negative_prompt_embeds])
            pooled = torch.cat([pooled, batch.negative_pooled_prompt_embeds])
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((rows,), batch.guidance_scale, device=self.device,
                                  dtype=torch.float32)
        scheduler = batch.scheduler
        for t in batch.timesteps:
            x = torch.cat([latents, latents]) if batch.do_cfg else latents
            timestep = t.expand(rows).to(x.dtype)
            pred = self.transformer(
                hidden_states=x, timestep=timestep / 1000, guidance=guidance,
                pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=batch.text_ids,
                img_ids=batch.latent_image_ids, return_dict=False,
            )[0]
            if batch.do_cfg:
                pos, neg = pred.chunk(2)
                pred = neg + batch.true_cfg_scale * (pos - neg)
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        batch.latents = latents


class FluxDecoding(DecodingStage):
    def __init__(self, vae: Any) -> None:
        super().__init__(vae)
        self.vae_factor = vae_scale_factor(vae)
        self.scaling = vae.config.scaling_factor
        self.shift = vae.config.shift_factor or 0.0

    def vae_input(self, batch: DiffusionBatch) -> torch.Tensor:
        h, w = latent_grid(batch.height, batch.width, self.vae_factor)
        latents = unpack_latents(batch.latents, h, w)
        return latents / self.scaling + self.shift


# The stage classes in run order (`build_stages` builds them); their `components` are what the
# residency manager plans with before anything is loaded.
STAGE_TYPES: tuple[type[Stage], ...] = (FluxInputValidation, FluxTextEncoding, FluxTimestepPreparation,
                                        FluxLatentPreparation, FluxDenoising, FluxDecoding)


def build_stages(c: dict[str, Any], config: Any, device: torch.device) -> list[Stage]:
    """The FLUX stage list over loaded components `c`."""
    factor = vae_scale_factor(c["vae"])
    return [
        FluxInputValidation(config, size_multiple=factor * 2),
        FluxTextEncoding(c["tokenizer"], c["text_encoder"], c["tokenizer_2"], c["text_encoder_2"],
                         config.max_sequence_length, device),
        FluxTimestepPreparation(c["scheduler"], factor, device),
        FluxLatentPreparation(c["transformer"].config.in_channels, factor, device),
        FluxDenoising(c["transformer"], device),
        FluxDecoding(c["vae"]),
    ]


def default_size(c: dict[str, Any]) -> int:
    """Default image side: 128 latent tokens' worth (1024 px for FLUX.1's 8x VAE)."""
    return 128 * vae_scale_factor(c["vae"])
