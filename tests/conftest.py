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


@pytest.fixture(scope="session")
def no_tokenizer_checkpoint(llama_path, tmp_path_factory) -> Path:
    """The llama checkpoint's config and weights only: no tokenizer files (skip_tokenizer_init)."""
    import shutil

    path = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (llama_path / name).is_file():
            shutil.copy(llama_path / name, path / name)
    assert (path / "model.safetensors").is_file()
    return path


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


# ---- training <-> rollout handover helpers (tests/test_weight_update.py, tests/test_pause.py)


def sgd_steps(model, steps: int, lr: float, seed: int, batch: int = 4, seq_len: int = 24) -> None:
    """A few plain SGD steps of next-token loss on random token batches: an RL trainer's update in
    miniature. Large `lr` moves the weights enough that greedy outputs change."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids = torch.randint(2, VOCAB, (batch, seq_len), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def named_weights(model) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, detached copy) of every parameter of an HF model, in module order."""
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def hf_greedy_scores(model, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens and the [steps, vocab] log-softmax of the raw logits at each step (fp32)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.log_softmax(torch.stack([s[0] for s in out.logits]).float(), dim=-1)


def hf_greedy_logprobs(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """HF greedy tokens and the log-softmax of the raw logits at each chosen token (fp32)."""
    tokens, logp = hf_greedy_scores(model, prompt, max_new)
    return tokens, logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InThread:
    """Run `fn(*args)` in a daemon thread; `result(timeout)` re-raises its exception, and fails the
    test (instead of hanging it) if the call has not returned in time."""

    def __init__(self, fn, *args, name: str = "helper", **kwargs) -> None:
        import threading

        self.value = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                self.error = e

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float = 60.0):
        self.thread.join(timeout)
        if self.thread.is_alive():
            pytest.fail(f"thread {self.thread.name!r} did not finish within {timeout} s (hang)")
        if self.error is not None:
            raise self.error
        return self.value


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` (no sleeps for correctness: only a bounded wait for another thread)."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.001)


# ---- Triton kernels run by the interpreter on CPU. It is chosen when triton is first imported, so a
# test file that has interpreted tests runs itself again in a subprocess with TRITON_INTERPRET=1.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")


def _index_scalars_as_later_tritons_do() -> None:
    """Triton 3.6's interpreter (the GPU hosts' version) turns a scalar argument into a Python int
    with `int()` of a one-element array, which NumPy >= 2.4 refuses, so a `range` over an int
    argument fails there. Later Tritons squeeze the array first; the interpreter run of a 3.6
    install gets the same fix."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_scalars", False):
        return
    import inspect

    if "squeeze()" in inspect.getsource(original):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_scalars = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _index_scalars_as_later_tritons_do()


def rerun_under_interpreter(test_file: str) -> str:
    """Run `test_file` in a subprocess with TRITON_INTERPRET=1 and assert its tests pass (the
    calling test skips itself there); skips when this process is that run. Returns the run's
    summary line."""
    import subprocess
    import sys

    if INTERPRETED:
        pytest.skip("this is the interpreter run")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" in proc.stdout
    return proc.stdout.strip().splitlines()[-1]
