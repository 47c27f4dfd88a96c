"""Tiny random FLUX and SDXL pipelines in diffusers format, built offline (tests, the demo model).

Each component is a real diffusers/transformers class with a tiny config and seeded random weights,
saved with its own `save_pretrained` next to a `model_index.json` written here. The tokenizers are
built from vocabularies made in code: a byte-level CLIP BPE (every byte is a token, plus a few merges)
and a T5 unigram tokenizer over single characters and a few words.
"""

from __future__ import annotations

import json
import os
import string
from typing import Any

import torch

CLIP_MERGES = ("t h", "th e</w>", "a n", "an d</w>", "o f</w>", "i n", "c a", "ca t</w>", "d o",
               "do g</w>", "r e", "e d</w>")
T5_WORDS = ("the", "a", "of", "and", "in", "cat", "dog", "photo", "red", "blue", "sky", "tree")


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for the bytes 0..255, in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def clip_tokenizer(model_max_length: int = 77) -> Any:
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    vocab: dict[str, int] = {}
    for s in symbols:
        vocab[s] = len(vocab)
    for s in symbols:
        vocab[s + "</w>"] = len(vocab)
    for merge in CLIP_MERGES:
        vocab[merge.replace(" ", "")] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    merges: Any = [tuple(m.split()) for m in CLIP_MERGES]  # pairs, as the tokenizer takes them
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def t5_tokenizer(model_max_length: int = 512) -> Any:
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [("\u2581" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    pieces += [("\u2581" + w, -2.5) for w in T5_WORDS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def _clip_config(vocab_size: int, tok: Any, hidden: int, projection: int, layers: int) -> Any:
    from transformers import CLIPTextConfig

    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden + 5,
        num_attention_heads=4, num_hidden_layers=layers, max_position_embeddings=77,
        projection_dim=projection, hidden_act="gelu", layer_norm_eps=1e-5,
        bos_token_id=tok.convert_tokens_to_ids("<|startoftext|>"), eos_token_id=eos,
        pad_token_id=eos,
    )


def _scale_weights(module: torch.nn.Module, std: float) -> None:
    """Wider random weights than the default init, so images depend visibly on prompt and seed."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)


def _save(path: str, kind: str, components: dict[str, Any], extra: dict[str, Any]) -> str:
    os.makedirs(path, exist_ok=True)
    index: dict[str, Any] = {"_class_name": kind, **extra}
    for name, module in components.items():
        library = "diffusers" if type(module).__module__.startswith("diffusers") else "transformers"
        index[name] = [library, type(module).__name__]
        sub = os.path.join(path, name)
        if hasattr(module, "save_config") and not hasattr(module, "parameters"):
            module.save_config(sub)  # a scheduler
        else:
            module.save_pretrained(sub)
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return path


def build_tiny_flux(path: str, seed: int = 0, dim: int = 32, weight_std: float | None = 0.2,
                    dtype: torch.dtype = torch.float32, layers: int = 1,
                    single_layers: int = 1) -> str:
    """A FLUX.1-style pipeline (guidance embedding, CLIP + T5, 2-block VAE) saved at `path`, with
    `layers` dual-stream and `single_layers` single-stream transformer blocks."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    text_encoder = CLIPTextModel(_clip_config(len(tok), tok, 32, 32, 2))
    t5_options: dict[str, Any] = dict(
        vocab_size=len(tok2), d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
        use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    t5 = T5EncoderModel(T5Config(**t5_options))
    heads = 2
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=layers, num_single_layers=single_layers,
        attention_head_dim=dim // heads, num_attention_heads=heads, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(dim // heads // 4, dim // heads // 4, dim // heads // 2))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=4, sample_size=32, use_quant_conv=False,
        use_post_quant_conv=False, scaling_factor=1.5035, shift_factor=0.0609)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
        base_shift=0.5, max_shift=1.15)
    modules: dict[str, Any] = {"text_encoder": text_encoder, "text_encoder_2": t5,
                               "transformer": transformer, "vae": vae}
    for m in modules.values():
        if weight_std is not None:
            _scale_weights(m, weight_std)
        if dtype != torch.float32:
            m.to(dtype)
    return _save(path, "FluxPipeline", {**modules, "tokenizer": tok, "tokenizer_2": tok2,
                                        "scheduler": scheduler}, {})


def build_tiny_sdxl(path: str, seed: int = 0, force_zeros_for_empty_prompt: bool = True,
                    weight_std: float | None = 0.1) -> str:
    """An SDXL-style pipeline (two CLIP encoders, text_time UNet, Euler scheduler) saved at `path`."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tok, tok2 = clip_tokenizer(), clip_tokenizer()
    text_encoder = CLIPTextModel(_clip_config(len(tok), tok, 32, 32, 2))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(len(tok2), tok2, 32, 32, 2))
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(16, 32),
        layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1), projection_class_embeddings_input_dim=8 * 6 + 32,
        cross_attention_dim=64, norm_num_groups=4)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=4, sample_size=32, scaling_factor=0.13025)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
        timestep_spacing="leading", prediction_type="epsilon")
    modules: dict[str, Any] = {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
                               "unet": unet, "vae": vae}
    if weight_std is not None:
        for m in modules.values():
            _scale_weights(m, weight_std)
    return _save(path, "StableDiffusionXLPipeline",
                 {**modules, "tokenizer": tok, "tokenizer_2": tok2, "scheduler": scheduler},
                 {"force_zeros_for_empty_prompt": force_zeros_for_empty_prompt})


def build_demo(path: str) -> str:
    """The built-in `demo-diffusion` model: `build_tiny_flux` with seed 0, weights stored in float16."""
    return build_tiny_flux(path, seed=0, dtype=torch.float16)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write the demo-diffusion model")
    parser.add_argument("--out", required=True)
    build_demo(parser.parse_args().out)
