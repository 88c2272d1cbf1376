"""Walking a tool-call answer through a matcher as the engine does: the model's token where it chooses (checked
against the row's mask), the grammar's forced tokens where it dictates (each one accepted), the stop token at
the end; and the answer's text read back as the server reads it. Shared by the marker tests on a tiny vocabulary
and on Qwen 2.5's real one."""

from __future__ import annotations

from typing import Any

import torch

from corral.grammar_engines.answer_text import answer_text
from corral.grammar_engines.protocol import Matcher, TokenizerSpec, allocate_bitmask
from corral.grammars.contract import validate_output
from corral.grammars.spec import GrammarSpec

# A mask this narrow is checked token by token against what the matcher accepts.
NARROW = 256


def allowed_ids(matcher: Matcher, vocab_size: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.reshape(-1)[:vocab_size]).view(-1)


def check_mask_agrees(matcher: Matcher, tokenizer: TokenizerSpec, where: str) -> torch.Tensor:
    """The row's mask, after checking that a narrow one allows only tokens the matcher accepts (the bug: llguidance's
    mask held only `<tool_call>`'s special token, which its parser then refused)."""
    ids = allowed_ids(matcher, tokenizer.vocab_size)
    if len(ids) <= NARROW:
        for token in ids.tolist():
            if token not in tokenizer.stop_token_ids:
                refused = f"{where}: the mask allows {token}, the matcher refuses it"
                assert matcher.validate_tokens([token]) == 1, refused
    return ids


def write(matcher: Matcher, tokenizer: TokenizerSpec, text: str) -> list[int]:
    """Generate `text` as a model that writes it in the tokenizer's own tokens (a marker as its special token)
    would under this matcher, with jump-forward on: returns the answer's ids (with the stop token where the
grammar had not ended by itself). Fails where
    the mask refuses the model's token, a forced token is refused, or the answer cannot end."""
    hf: Any = tokenizer.hf_tokenizer
    decode = answer_text(hf).decode
    ids: list[int] = []
    for _ in range(4 * len(text) + 8):
        written = decode(ids)
        assert text.startswith(written), f"the answer left the text: {written!r}"
        if written == text:
            break
        mask = check_mask_agrees(matcher, tokenizer, f"after {written!r}")
        token = int(hf.encode(text[len(written) :], add_special_tokens=False)[0])
        assert token in set(mask.tolist()), f"after {written!r} the mask refuses {token} ({hf.decode([token])!r})"
        assert matcher.accept_token(token), matcher.error
        ids.append(token)
        forced = matcher.forced_tokens()
        for forced_token in forced:  # as the engine's jump-forward: every one must be accepted
            assert matcher.accept_token(forced_token), f"forced {forced} after {written!r}: {matcher.error}"
        ids += forced
    else:
        raise AssertionError(f"{text!r} was not written")
    assert matcher.can_terminate(), f"the answer {text!r} cannot end"
    if matcher.is_terminated():  # nothing can follow: the engine ends the answer here
        return ids
    stop = tokenizer.stop_token_ids[0]
    assert stop in set(check_mask_agrees(matcher, tokenizer, "at the end").tolist())
    assert matcher.accept_token(stop), matcher.error
    assert matcher.is_terminated()
    return [*ids, stop]


def read_back(spec: GrammarSpec, tokenizer: TokenizerSpec, ids: list[int]) -> Any:
    """The answer as the server reads it (special tokens skipped but a marker's), checked as a tool answer."""
    text = answer_text(tokenizer.hf_tokenizer).decode(ids)
    check = validate_output(spec, text)
    assert check.valid, (text, check.error)
    return check.value
