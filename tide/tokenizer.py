"""Loading the HF tokenizer of a checkpoint (shared by `Engine`, the scheduler and the HTTP side), and
the part of it the engine uses."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from tide.config import EngineConfig


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (any HF tokenizer has it)."""

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False,
               **kwargs: Any) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], tokenize: bool = True,
                            add_generation_prompt: bool = False) -> str | list[int]: ...


def decode(tokenizer: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool,
           spaces_between_special_tokens: bool = True) -> str:
    """`tokenizer.decode` with sglang's decoding switches. transformers' default for
    `spaces_between_special_tokens` (True) is left to it, so a tokenizer whose `decode` takes only
    `skip_special_tokens` serves every request that does not turn it off."""
    if spaces_between_special_tokens:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                            spaces_between_special_tokens=False)


def load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    """The tokenizer at `tokenizer_path` (default: `model_path`). None with `skip_tokenizer_init`
    or for a dummy-weights model without tokenizer files; ValueError naming the path for a real
    one without them. Its `model_max_length` is lifted: tide enforces the context length."""
    from transformers import AutoTokenizer

    if config.skip_tokenizer_init:
        return None
    path = config.tokenizer_path or config.model_path
    has_files = any(
        os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer_config.json")
    )
    if not has_files:
        if config.load_format == "dummy":
            return None
        field = "tokenizer_path" if config.tokenizer_path else "model_path"
        raise ValueError(f"{field} {path!r} has no tokenizer files (tokenizer.json); pass "
                         "skip_tokenizer_init=True (--skip-tokenizer-init) to serve token ids only")
    tokenizer = AutoTokenizer.from_pretrained(path)
    # tide bounds prompt length itself (context_length, with a clear error); the tokenizer's own
    # model_max_length would only add transformers' "Token indices sequence length is longer than
    # ..." warning for prompts tide is about to refuse anyway.
    tokenizer.model_max_length = _NO_LIMIT
    return tokenizer


_NO_LIMIT = int(1e30)  # transformers' own "no limit" value (VERY_LARGE_INTEGER)
