"""Train the tiny built-in demo model shipped in ``tide/demo_model``.

The corpus is the Python reference documentation bundled with the standard
library (``pydoc_data.topics``), so the script runs fully offline.  It trains a
byte-level BPE tokenizer, then a small Llama-architecture causal LM on CPU for a
wall-clock budget, and writes a Hugging Face model directory (bfloat16 weights,
tokenizer with a chat template, generation config).

Usage::

    python scripts/train_demo_model.py --out tide/demo_model [--minutes N]

Training is seeded.  ``--minutes`` calibrates the number of optimizer steps from
the measured step time (printed as ``--steps N``); pass ``--steps N`` instead to
reproduce a run exactly regardless of machine speed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import random
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]

# Each message renders as "<|role|>\n{content}<|end|>\n"; the prompt starts with BOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Standard-library modules whose docstrings supplement the reference topics.
DOCSTRING_MODULES = """
    builtins abc argparse bisect collections contextlib csv dataclasses datetime
    decimal difflib enum fractions functools heapq inspect io itertools json logging
    math operator os pathlib pickle random re shutil statistics string subprocess
    tempfile textwrap threading typing unittest urllib.parse weakref zipfile
""".split()

SAMPLE_PROMPTS = ["The for statement", "A class definition", "Exceptions are"]
SAMPLING_MODES: dict[str, dict[str, object]] = {
    "greedy": {"do_sample": False},
    "sampled": {"do_sample": True, "temperature": 0.8, "top_p": 0.95},
}


@dataclass(frozen=True)
class ModelShape:
    """Architecture hyperparameters of the demo model."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 512


def clean(text: str) -> str:
    """Normalise line endings and blank lines in a document."""
    text = text.replace("\r\n", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def first_paragraphs(text: str, max_chars: int = 600) -> str:
    """Return the leading paragraphs of ``text`` up to roughly ``max_chars``."""
    out: list[str] = []
    for para in text.split("\n\n")[1:]:  # skip the title line block
        para = para.strip()
        if not para or set(para) <= set("=-*"):
            continue
        out.append(para)
        if sum(len(p) for p in out) >= max_chars:
            break
    return "\n\n".join(out)


def own_doc(obj: object) -> str:
    """The object's own docstring (not inherited), dedented."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def module_docstrings(module_name: str) -> str:
    """Docstrings of a module and its public classes, methods and functions."""
    module = importlib.import_module(module_name)
    parts = [own_doc(module)]
    with (
        warnings.catch_warnings()
    ):  # deprecated aliases such as typing.io warn on access
        warnings.simplefilter("ignore", DeprecationWarning)
        for name, obj in vars(module).items():
            if (
                name.startswith("_")
                or getattr(obj, "__module__", None) != module.__name__
            ):
                continue
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            parts.append(own_doc(obj))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and inspect.isroutine(member):
                        parts.append(own_doc(member))
    return clean("\n\n".join(p for p in parts if len(p) > 40))


def build_corpus() -> tuple[list[str], list[list[dict[str, str]]]]:
    """Documents for language modelling and a few chat conversations."""
    docs = [clean(topics[name]) for name in sorted(topics)]
    docs += [module_docstrings(name) for name in DOCSTRING_MODULES]
    chats: list[list[dict[str, str]]] = []
    for name in sorted(topics):
        answer = first_paragraphs(clean(topics[name]))
        if not answer:
            continue
        subject = name.replace("-", " ")
        chats.append(
            [
                {"role": "user", "content": f"Tell me about {subject} in Python."},
                {"role": "assistant", "content": answer},
            ]
        )
    return docs, chats


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it for ``transformers``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Encoding a plain string prepends BOS, like Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=ModelShape.max_positions,
        clean_up_tokenization_spaces=False,
    )


def tokenize_corpus(
    tokenizer: PreTrainedTokenizerFast,
    docs: list[str],
    chats: list[list[dict[str, str]]],
) -> list[int]:
    """Concatenate ``<bos> doc <eos>`` and rendered chats into one token stream."""
    backend = tokenizer.backend_tokenizer
    pieces: list[list[int]] = []
    for doc in docs:
        pieces.append(backend.encode(doc).ids + [tokenizer.eos_token_id])
    for chat in chats:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        pieces.append(
            backend.encode(text, add_special_tokens=False).ids
            + [tokenizer.eos_token_id]
        )
    random.Random(0).shuffle(pieces)
    return [t for piece in pieces for t in piece]


def make_model(
    shape: ModelShape, tokenizer: PreTrainedTokenizerFast
) -> LlamaForCausalLM:
    """Build a freshly initialised Llama model for ``shape``."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len + 1`` tokens split into inputs and labels."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def lm_loss(model: LlamaForCausalLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (labels are already shifted)."""
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), y.reshape(-1)
    )


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM, data: torch.Tensor, seq_len: int, max_batches: int = 8
) -> float:
    """Average loss over contiguous non-overlapping windows of ``data``."""
    model.eval()
    n = min(max_batches * 8, (data.numel() - 1) // seq_len)
    starts = torch.arange(n) * seq_len
    losses = []
    for chunk in starts.split(8):
        windows = torch.stack([data[s : s + seq_len + 1] for s in chunk.tolist()])
        losses.append(lm_loss(model, windows[:, :-1], windows[:, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warmup followed by cosine decay to ``floor``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def make_config_portable(out: Path) -> None:
    """Use tokenizer_config keys that transformers 4.x and 5.x both understand."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in config:
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    path.write_text(json.dumps(config, indent=2) + "\n")


def show_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Print greedy and sampled continuations of a few prompts."""
    model.eval()
    torch.manual_seed(0)
    prompts = SAMPLE_PROMPTS + [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": "Tell me about the while statement in Python.",
                }
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
    ]
    for prompt in prompts:
        ids = tokenizer(
            prompt, return_tensors="pt", add_special_tokens=not prompt.startswith(BOS)
        )
        for mode, kwargs in SAMPLING_MODES.items():
            with torch.no_grad():
                out = model.generate(
                    **ids,
                    max_new_tokens=48,
                    pad_token_id=tokenizer.pad_token_id,
                    **kwargs,
                )
            text = tokenizer.decode(
                out[0][ids["input_ids"].shape[1] :], skip_special_tokens=False
            )
            print(f"--- {mode} | {prompt!r}\n{text}\n")


def dir_size(path: Path) -> int:
    """Total size in bytes of the files in ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tide/demo_model"))
    parser.add_argument(
        "--minutes", type=float, default=12.0, help="wall-clock training budget"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="fixed step count (overrides --minutes)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    shape = ModelShape()

    docs, chats = build_corpus()
    n_chars = sum(map(len, docs))
    print(f"corpus: {len(docs)} documents, {n_chars} chars, {len(chats)} chats")
    tokenizer = train_tokenizer(docs, shape.vocab_size)
    stream = torch.tensor(tokenize_corpus(tokenizer, docs, chats), dtype=torch.long)
    split = int(stream.numel() * 0.95)
    train_data, val_data = stream[:split], stream[split:]
    print(f"tokens: {stream.numel()} (train {split}, val {stream.numel() - split})")

    model = make_model(shape, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    total = (
        args.steps if args.steps is not None else 10**9
    )  # resolved after warmup when timing
    budget_s = args.minutes * 60.0
    start = time.perf_counter()
    loss_ema: float | None = None
    model.train()
    step = 0
    while step < total:
        lr = lr_at(step, total, args.warmup, args.lr, args.lr * 0.1)
        for group in optim.param_groups:
            group["lr"] = lr
        x, y = sample_batch(train_data, args.batch_size, args.seq_len, gen)
        loss = lm_loss(model, x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        step += 1
        loss_ema = (
            loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        )
        elapsed = time.perf_counter() - start
        if args.steps is None and step == args.warmup:
            total = max(args.warmup + 1, int(budget_s / (elapsed / step)))
            print(f"calibrated: {elapsed / step:.2f}s/step -> {total} steps")
            print(f"  (reproduce this schedule with --steps {total})")
        if step % 25 == 0 or step == total:
            shown_total = total if total < 10**9 else "?"
            print(
                f"step {step:5d}/{shown_total}  loss {loss.item():.3f}"
                f"  ema {loss_ema:.3f}  lr {lr:.2e}  {elapsed / 60:.1f} min",
                flush=True,
            )
        if step % 200 == 0:
            print(
                f"  val loss {evaluate(model, val_data, args.seq_len):.3f}", flush=True
            )
    train_minutes = (time.perf_counter() - start) / 60
    val_loss = evaluate(model, val_data, args.seq_len)
    print(f"done: {step} steps in {train_minutes:.1f} min")
    print(f"train loss (ema) {loss_ema:.3f}, val loss {val_loss:.3f}")

    show_samples(model, tokenizer)

    args.out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    make_config_portable(args.out)
    for path in (
        args.out.iterdir()
    ):  # safetensors writes 0600; package data must be world-readable
        path.chmod(0o644)
    stats = {
        "parameters": n_params,
        "steps": step,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "peak_lr": args.lr,
        "train_minutes": round(train_minutes, 1),
        "train_loss": round(loss_ema or float("nan"), 3),
        "val_loss": round(val_loss, 3),
        "tokens": stream.numel(),
    }
    print("stats:", json.dumps(stats))

    # Round-trip check from disk, as the engine will load it.
    reloaded = AutoModelForCausalLM.from_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.out)
    print(
        f"saved {args.out} ({dir_size(args.out) / 1e6:.2f} MB, dtype {reloaded.dtype})"
    )


if __name__ == "__main__":
    main()
