"""SDXL: a UNet denoiser conditioned on two CLIP encoders (penultimate hidden states concatenated, the
second encoder's projected pooled output) plus size/crop ids, with classifier-free guidance.

Guidance: `guidance_scale > 1` runs the unconditional (or negative) prediction in the same forward as
the conditional one and mixes `uncond + guidance_scale * (cond - uncond)`. Without a negative prompt
the unconditional embeddings are zeros when the pipeline's `force_zeros_for_empty_prompt` is set (the
SDXL default), else the embeddings of "". A negative prompt with `guidance_scale <= 1`, or any
`true_cfg_scale` other than 1, is refused.
"""

from __future__ import annotations

import copy
from typing import Any

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
    "scheduler": ("EulerDiscreteScheduler",),
    "text_encoder": ("CLIPTextModel",),
    "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
    "text_encoder_2": ("CLIPTextModelWithProjection",),
    "tokenizer_2": ("CLIPTokenizer", "CLIPTokenizerFast"),
    "unet": ("UNet2DConditionModel",),
    "vae": ("AutoencoderKL",),
}
DEFAULT_GUIDANCE_SCALE = 5.0


def vae_scale_factor(vae: Any) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


class SDXLInputValidation(InputValidationStage):
    def check_guidance(self, req: ImageRequest) -> None:
        if req.true_cfg_scale != 1.0:
            raise ValueError("true_cfg_scale applies to FLUX only; SDXL's classifier-free guidance is "
                             "guidance_scale")
        if req.negative_prompts is not None and req.guidance_scale <= 1.0:
            raise ValueError("negative_prompt needs classifier-free guidance: pass guidance_scale > 1")

    def uses_cfg(self, req: ImageRequest) -> bool:
        return req.guidance_scale > 1.0


class SDXLTextEncoding(Stage):
    """Both CLIP encoders over the prompts and the negative prompts that need encoding."""

    name = "text_encoding"
    components = ("text_encoder", "text_encoder_2")

    def __init__(self, tokenizer: Any, text_encoder: Any, tokenizer_2: Any, text_encoder_2: Any,
                 force_zeros_for_empty_prompt: bool, device: torch.device) -> None:
        self.encoders = ((tokenizer, text_encoder), (tokenizer_2, text_encoder_2))
        self.lengths = tuple(min(tok.model_max_length, enc.config.max_position_embeddings)
                             for tok, enc in self.encoders)
        self.force_zeros = force_zeros_for_empty_prompt
        self.dtype = text_encoder_2.dtype
        self.device = device

    def _encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, pooled = [], None
        for (tok, enc), length in zip(self.encoders, self.lengths):
            ids = tokenize(tok, texts, length).to(self.device)
            out = enc(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            if enc is self.encoders[1][1]:
                pooled = out[0]  # the projected pooled embedding (text_embeds)
        return torch.cat(hidden, dim=-1).to(self.dtype), pooled.to(self.dtype)

    def __call__(self, batch: DiffusionBatch) -> None:
        n = len(batch.prompts)
        texts = list(batch.prompts)
        # Where each prompt's unconditional embedding comes from: a row of the encoder output, or
        # None for zeros.
        neg_rows: list[int | None] = []
        if batch.do_cfg:
            for neg in batch.negative_prompts:
                if neg is None and self.force_zeros:
                    neg_rows.append(None)
                else:
                    neg_rows.append(len(texts))
                    texts.append(neg if neg is not None else "")
        embeds, pooled = self._encode(texts)
        batch.prompt_embeds = repeat_per_image(embeds[:n], batch.repeats)
        batch.pooled_prompt_embeds = repeat_per_image(pooled[:n], batch.repeats)
        if batch.do_cfg:
            zero_e, zero_p = torch.zeros_like(embeds[0]), torch.zeros_like(pooled[0])
            neg_e = torch.stack([embeds[r] if r is not None else zero_e for r in neg_rows])
            neg_p = torch.stack([pooled[r] if r is not None else zero_p for r in neg_rows])
            batch.negative_prompt_embeds = repeat_per_image(neg_e, batch.repeats)
            batch.negative_pooled_prompt_embeds = repeat_per_image(neg_p, batch.repeats)
        size = [batch.height, batch.width, 0, 0, batch.height, batch.width]  # original, crop, target
        rows = batch.num_images * (2 if batch.do_cfg else 1)
        batch.add_time_ids = torch.tensor([size], dtype=embeds.dtype, device=self.device).repeat(rows, 1)


class SDXLTimestepPreparation(Stage):
    """A batch-owned copy of the scheduler set to `num_inference_steps`."""

    name = "timestep_preparation"

    def __init__(self, scheduler: Any, device: torch.device) -> None:
        self.scheduler = scheduler
        self.device = device

    def __call__(self, batch: DiffusionBatch) -> None:
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(batch.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        batch.scheduler = scheduler
        batch.timesteps = scheduler.timesteps


class SDXLLatentPreparation(Stage):
    """Seeded Gaussian noise on the latent grid, scaled to the schedule's initial sigma."""

    name = "latent_preparation"

    def __init__(self, in_channels: int, vae_factor: int, device: torch.device) -> None:
        self.channels = in_channels
        self.vae_factor = vae_factor
        self.device = device

    def __call__(self, batch: DiffusionBatch) -> None:
        shape = (self.channels, batch.height // self.vae_factor, batch.width // self.vae_factor)
        noise = initial_noise(batch, shape, self.device, batch.prompt_embeds.dtype)
        batch.latents = noise * batch.scheduler.init_noise_sigma


class SDXLDenoising(Stage):
    """The UNet loop; with guidance the unconditional and conditional rows share one forward."""

    name = "denoising"
    components = ("unet",)

    def __init__(self, unet: Any) -> None:
        self.unet = unet

    def __call__(self, batch: DiffusionBatch) -> None:
        latents = batch.latents
        embeds, pooled = batch.prompt_embeds, batch.pooled_prompt_embeds
        if batch.do_cfg:
            embeds = torch.cat([batch.negative_prompt_embeds, embeds])
            pooled = torch.cat([batch.negative_pooled_prompt_embeds, pooled])
        cond = {"text_embeds": pooled, "time_ids": batch.add_time_ids}
        scheduler = batch.scheduler
        for t in batch.timesteps:
            x = torch.cat([latents, latents]) if batch.do_cfg else latents
            x = scheduler.scale_model_input(x, t)
            pred = self.unet(x, t, encoder_hidden_states=embeds, added_cond_kwargs=cond,
                             return_dict=False)[0]
            if batch.do_cfg:
                uncond, text = pred.chunk(2)
                pred = uncond + batch.guidance_scale * (text - uncond)
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        batch.latents = latents


class SDXLDecoding(DecodingStage):
    def __init__(self, vae: Any) -> None:
        super().__init__(vae)
        cfg = vae.config
        self.scaling = cfg.scaling_factor
        mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        self.mean_std = None
        if mean is not None and std is not None:
            shape = (1, len(mean), 1, 1)
            self.mean_std = (torch.tensor(mean).view(shape), torch.tensor(std).view(shape))

    def vae_input(self, batch: DiffusionBatch) -> torch.Tensor:
        latents = batch.latents
        if self.mean_std is None:
            return latents / self.scaling
        mean, std = (t.to(latents.device, latents.dtype) for t in self.mean_std)
        return latents * std / self.scaling + mean


def check_components(c: dict[str, Any]) -> None:
    """ValueError if the UNet's added conditioning does not fit the text encoder (a wrong config)."""
    unet = c["unet"]
    if unet.config.get("time_cond_proj_dim") is not None:
        raise ValueError("unet: guidance-distilled UNets (time_cond_proj_dim) are not supported")
    if unet.config.get("addition_embed_type") != "text_time":
        raise ValueError("unet: SDXL needs addition_embed_type 'text_time'")
    passed = unet.config.addition_time_embed_dim * 6 + c["text_encoder_2"].config.projection_dim
    expected = unet.add_embedding.linear_1.in_features
    if passed != expected:
        raise ValueError(f"unet: added conditioning of width {expected} expected, the text encoder and "
                         f"size ids give {passed}")


# The stage classes in run order (`build_stages` builds them); see flux.STAGE_TYPES.
STAGE_TYPES: tuple[type[Stage], ...] = (SDXLInputValidation, SDXLTextEncoding, SDXLTimestepPreparation,
                                        SDXLLatentPreparation, SDXLDenoising, SDXLDecoding)


def build_stages(c: dict[str, Any], config: Any, device: torch.device,
                 force_zeros_for_empty_prompt: bool = True) -> list[Stage]:
    """The SDXL stage list over loaded components `c`."""
    check_components(c)
    factor = vae_scale_factor(c["vae"])
    return [
        SDXLInputValidation(config, size_multiple=factor),
        SDXLTextEncoding(c["tokenizer"], c["text_encoder"], c["tokenizer_2"], c["text_encoder_2"],
                         force_zeros_for_empty_prompt, device),
        SDXLTimestepPreparation(c["scheduler"], device),
        SDXLLatentPreparation(c["unet"].config.in_channels, factor, device),
        SDXLDenoising(c["unet"]),
        SDXLDecoding(c["vae"]),
    ]


def default_size(c: dict[str, Any]) -> int:
    return int(c["unet"].config.sample_size) * vae_scale_factor(c["vae"])
