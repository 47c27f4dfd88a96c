"""Incremental detokenization on the server side: multi-byte characters and stop strings."""

from __future__ import annotations

import pytest

from tide.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from conftest import _tokenizer_files
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    _tokenizer_files(path)
    return AutoTokenizer.from_pretrained(path)


def _feed(tok, prompt: str, output: str, stop=(), chunk: int = 1):
    """Stream `output`'s tokens `chunk` at a time; return (detok, visible text after each step)."""
    prompt_ids = tok.encode(prompt)
    out_ids = tok.encode(output)
    detok = IncrementalDetokenizer(tok, prompt_ids, True, list(stop))
    seen = []
    for i in range(0, len(out_ids), chunk):
        detok.add(out_ids[i : i + chunk])
        seen.append(detok.visible_text)
    return detok, seen, out_ids


def _assert_growing(seen: list[str]) -> None:
    for a, b in zip(seen, seen[1:], strict=False):
        assert b.startswith(a), (a, b)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_characters_are_held_until_complete(tokenizer, chunk):
    text = " naïve café — 你好 🙂 done"
    detok, seen, ids = _feed(tokenizer, "The quick", text, chunk=chunk)
    # the test means something only if some token is a piece of a character
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    assert all("\ufffd" not in s for s in seen)
    _assert_growing(seen)
    detok.finish()
    assert detok.visible_text == text == tokenizer.decode(ids)


def test_incomplete_character_is_flushed_at_finish(tokenizer):
    ids = tokenizer.encode(" ok 🙂")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), True, [])
    detok.add(ids[:-1])  # the emoji's last byte never comes
    assert detok.visible_text == " ok "
    detok.finish()
    assert detok.visible_text.startswith(" ok ") and detok.visible_text.endswith("\ufffd")


def test_leading_space_kept_with_prompt_context(tokenizer):
    detok, seen, _ = _feed(tokenizer, "Hello", " world and more")
    detok.finish()
    assert detok.visible_text == " world and more"


def test_stop_string_never_released(tokenizer):
    output = " quick brown fox jumps over"
    detok, seen, _ = _feed(tokenizer, "The", output, stop=["brown f"])
    assert detok.stop_matched == "brown f"
    for s in seen:
        assert " quick ".startswith(s), s  # never a character of the stop string
    detok.finish()
    assert detok.visible_text == " quick "


def test_stop_prefix_held_then_released(tokenizer):
    """Text that might start a stop string waits; once it cannot, it is shown."""
    output = " the fox jumps over the fox!"
    detok, seen, _ = _feed(tokenizer, "See", output, stop=["fox!"])
    _assert_growing(seen)
    assert any(s.endswith(" the ") and "fox" not in s for s in seen)
    assert any("fox jumps" in s for s in seen)  # the first "fox" was released
    detok.finish()
    assert detok.visible_text == " the fox jumps over the "


def test_earliest_of_several_stops_wins(tokenizer):
    detok, _, _ = _feed(tokenizer, "A", " one two three four", stop=["four", "two", "three"],
                        chunk=10)
    assert detok.stop_matched == "two"
    assert detok.visible_text == " one "


def test_unfinished_partial_stop_is_flushed_at_finish(tokenizer):
    detok, seen, _ = _feed(tokenizer, "A", " fine, the end", stop=["endless"])
    assert seen[-1] == " fine, the "  # "end" could begin "endless"
    detok.finish()
    assert detok.visible_text == " fine, the end"


class _Counting:
    """A tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=False, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)


@pytest.mark.parametrize("chunk", [1, 5])
def test_bytes_no_token_completes_are_not_held_forever(tokenizer, chunk):
    """A lone UTF-8 continuation byte, sampled again and again (a `logit_bias` of 100 on it does
    that), never completes a character: the decoder must not hold it back and decode the whole
    held run again on every token (quadratic: 8000 tokens took seconds, in the scheduler loop and
    on the server's event loop)."""
    lone = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"
                and tokenizer.decode([i, i]) == "\ufffd\ufffd")
    counting = _Counting(tokenizer)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("Hi"), True, ["zz"])
    n = 3000
    seen = []
    for _ in range(0, n, chunk):
        detok.add([lone] * chunk)
        seen.append(detok.visible_text)
    _assert_growing(seen)
    assert counting.decoded < 40 * n, counting.decoded  # linear, not ~n * n / 2
    assert len(detok.text) >= n - 2 * 8 * chunk  # shown as it comes, not all at finish
    detok.finish()
    assert detok.visible_text == "\ufffd" * n == tokenizer.decode([lone] * n)
