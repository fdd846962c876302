"""Constrained decoding: a rollout's verdict protocol (``<sampler>.constrain_verdict``, as
docs/usage.md states it) and the proposer's JSON schema (``rule_search.constrain_proposer``: once
the grammar is complete, only the end-of-turn token).

The masks come from llguidance (vLLM's backend too, so both engines hold the same grammars),
which matches the grammar on the generated tokens' bytes, however the tokenizer splits them.
A mask depends only on the row's own tokens: seeded results stay the same on any worker count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..stageb.text import regex_literal

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the vLLM engine imports this module before its worker
# sets OMP_NUM_THREADS, which must precede torch's import (model.vllm.cpu_threads).

VERDICT_LABEL = "Verdict: "
REASON_LABEL = "Reason: "


def verdict_line_regex(vocab) -> str:
    """The verdict line exactly, then a one-line reason that does not start with white space
    (the parser strips it and needs something left), as a regex."""
    words = "|".join(regex_literal(w) for w in (vocab.pass_text, vocab.fail_text))
    return f"{regex_literal(VERDICT_LABEL)}({words})\\n{regex_literal(REASON_LABEL)}[^\\s]{_ONE_LINE}*"


# Not a line break to Python's str.splitlines (what the verdict parser splits on).
_ONE_LINE = "[^\\n\\r\\x0b\\x0c\\x1c\\x1d\\x1e\\x85\\u2028\\u2029]"


class Grammars:
    """Per generate call, a logits processor holding each row to a regex or a JSON schema."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self._llguidance = llguidance
        self.end_id = tokenizer.eos_token_id
        self._tokenizer = llguidance.LLTokenizer(_tokenizer_json(tokenizer), n_vocab=vocab_size,
                                                 eos_token=self.end_id)
        _check_token_bytes(self._tokenizer, tokenizer)
        self._grammars: dict[tuple[str, str], str] = {}

    def processor(self, rows: int, prompt_length: int, *, regex: str | None = None,
                  json_schema: str | None = None) -> "GrammarProcessor":
        if (regex is None) == (json_schema is None):
            raise ValueError("give exactly one of regex and json_schema")
        key = ("regex", regex) if regex is not None else ("json", json_schema)
        grammar = self._grammars.get(key)
        if grammar is None:
            build = (self._llguidance.LLMatcher.grammar_from_regex if regex is not None
                     else self._llguidance.LLMatcher.grammar_from_json_schema)
            grammar = self._grammars[key] = build(key[1])
        matchers = [self._llguidance.LLMatcher(self._tokenizer, grammar, log_level=0) for _ in range(rows)]
        if matchers[0].is_error():
            raise ValueError(f"{key[0]} grammar {key[1][:200]!r}: {matchers[0].get_error()}")
        return GrammarProcessor(matchers, prompt_length, self.end_id)


def _tokenizer_json(tokenizer) -> str:
    """The fast tokenizer's definition as llguidance must read it: no padding or truncation,
    and a plain ByteLevel decoder where the tokenizer is byte-level. llguidance reads bytes as
    byte-level only with that decoder, and transformers converts the embedded GGUF's tokenizer
    with a decoder sequence (``Ġany`` was then read as C4 A0 ``any``: docs/performance.md)."""
    import json
    from copy import copy

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    definition = json.loads(backend.to_str())
    decoder = definition.get("decoder") or {}
    if decoder.get("type") == "Sequence" and _is_byte_level(definition.get("pre_tokenizer")):
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            definition["decoder"] = byte_level[0]
    return json.dumps(definition, ensure_ascii=False)


def _is_byte_level(pre_tokenizer) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


# Text whose bytes llguidance must read back from the tokenizer's ids: the pieces the
# grammars hold (labels after a space, JSON punctuation, a line break, non-ASCII verdict words).
_PROBE = 'Verdict: pass\nReason: {"op": "upsert", "text": "any rule"} 不通过'


def _check_token_bytes(lltokenizer, tokenizer) -> None:
    """Refuse a tokenizer whose tokens llguidance reads as other bytes than the text they
    encode: every mask would be wrong, and the run would fail mid-generation or, worse,
    sample garbage. (A leading space is allowed: SentencePiece adds one.)"""
    ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    got = lltokenizer.decode_bytes(ids)
    if got not in (_PROBE.encode(), b" " + _PROBE.encode()):
        raise ValueError(
            f"constrained decoding cannot use this tokenizer: llguidance reads its tokens for "
            f"{_PROBE!r} as {got[:120]!r}; set the sampler's constrain_verdict and "
            f"rule_search.constrain_proposer to false for this model")


class GrammarProcessor:
    """A transformers logits processor: row ``i`` may only sample what its matcher allows. A
    stopped matcher either took the end-of-turn token (the row is done: ``free``) or completed
    its grammar on another token, and then allows only the end-of-turn token, once. Runs before
    temperature and top-p (generate puts custom processors ahead of its warpers)."""

    def __init__(self, matchers: list, prompt_length: int, end_id: int):
        self.matchers = matchers
        self.prompt_length = prompt_length
        self.end_id = end_id
        self.free = [False] * len(matchers)
        self._ending = [False] * len(matchers)  # the grammar is complete: the next token is the end

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_length
        for row, matcher in enumerate(self.matchers):
            if self.free[row]:
                continue
            if self._ending[row]:  # it took the forced end token: finished
                self.free[row] = True
                continue
            if generated > 0:
                token = int(input_ids[row, -1])
                if not matcher.consume_token(token):
                    raise RuntimeError(f"constrained decoding: token {token} was not allowed: {matcher.get_error()}")
                if matcher.is_stopped():
                    if token == self.end_id:  # it took the end-of-turn token: the row is done
                        self.free[row] = True
                        continue
                    self._ending[row] = True
                    scores[row].fill_(float("-inf"))
                    scores[row, self.end_id] = 0.0
                    continue
            allowed = allowed_tokens(matcher.compute_bitmask(), scores.shape[1])
            scores[row].masked_fill_(~allowed.to(scores.device), float("-inf"))
        return scores


def allowed_tokens(bitmask: bytes, width: int) -> torch.Tensor:
    """llguidance's mask (one bit per token, 32-bit little-endian words) as booleans."""
    import torch

    raw = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    bits = ((raw.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()[:width]
    out = torch.zeros(width, dtype=torch.bool)
    out[: len(bits)] = bits
    return out
