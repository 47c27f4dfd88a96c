"""Shared fixtures: tiny random HF checkpoints built and saved with `transformers` (fp32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One intra-op thread by default: the models are tiny, and on a shared 2-core machine multi-threaded
# kernels spin against other processes and run up to ~100x slower. TIDE_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("TIDE_TEST_THREADS", "1")))

VOCAB = 512


def _tokenizer_files(path: Path) -> None:
    """A small byte-level BPE tokenizer so text prompts and stop strings work."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "Python is a programming language that lets you work quickly.",
        "In the beginning was the word, and the word was with the model.",
    ]
    tok.train_from_iterator(text * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    fast.save_pretrained(path)


def build_checkpoint(path: Path, arch: str, **overrides) -> Path:
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=1,
    )
    common.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "qwen3":
        common.setdefault("head_dim", 32)
        config = transformers.Qwen3Config(**common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        raise ValueError(arch)
    # Larger-than-default init spreads the logits, so greedy choices are far from ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
            else:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path)
    _tokenizer_files(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": build_checkpoint(
            root / "llama",
            "llama",
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        "qwen2": build_checkpoint(root / "qwen2", "qwen2"),
        "qwen3": build_checkpoint(root / "qwen3", "qwen3", tie_word_embeddings=True),
    }


@pytest.fixture(scope="session")
def llama_path(checkpoints) -> Path:
    return checkpoints["llama"]


# ---- shared engines, HF reference models and prompts (session scoped: built once, reused)


def random_prompts(seed: int, lengths, low: int = 2, high: int = VOCAB) -> list[list[int]]:
    """Deterministic random token-id prompts (ids in [low, high), so no eos/bos by default)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="session")
def engine_for(checkpoints):
    """`engine_for(arch)`: a default-options `tide.Engine` per checkpoint, shared by the session.

    Shared engines keep their radix cache between tests; tests that read counters use deltas, and
    tests that need a pristine engine build their own.
    """
    import tide

    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = tide.Engine(str(checkpoints[arch]))
        return cache[arch]

    yield get
    for engine in cache.values():
        engine.shutdown()


@pytest.fixture(scope="session")
def llama_engine(engine_for):
    return engine_for("llama")


@pytest.fixture(scope="session")
def hf_model_for(checkpoints):
    """`hf_model_for(arch)`: the fp32 `transformers` model of a checkpoint (eos disabled), cached."""
    import transformers

    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoints[arch], dtype=torch.float32
            ).eval()
            model.generation_config.eos_token_id = None
            cache[arch] = model
        return cache[arch]

    return get
