"""Text in and out of a chat model, shared by the engines (``ChatText`` for one tokenizer).
Every message content is tokenized as text (``PromptEncoder``): a control token's spelling in
data never becomes that token, or a ticket could close the user turn (docs/formats.md).
"""

from __future__ import annotations

import re
import time
from typing import NamedTuple

from ..stageb import prompts
from .records import ChunkResult, Sample, TicketRollout, TicketVerdictProbability, VerdictChunkResult

END_OF_TURN = ("<|im_end|>", "<|endoftext|>")


def render(tokenizer, messages: list[dict]) -> str:
    """The prompt text of ``messages``, thinking off where the template knows the switch (Qwen3)."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
    except TypeError:  # a template (or tokenizer) that does not know enable_thinking
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def stop_strings(tokenizer, extra: list[str] | None = None) -> list[str]:
    """The tokenizer's eos and the ``END_OF_TURN`` tokens it has (always, as upstream), then
    ``extra`` (``model.stop``), no repeats."""
    vocab = tokenizer.get_vocab()
    defaults = [t for t in (tokenizer.eos_token, *END_OF_TURN) if t and t in vocab]
    return list(dict.fromkeys([*defaults, *(extra or [])]))


def clean(text: str, stops: list[str]) -> str:
    """The completion cut at the first stop string, stripped. A role marker the model echoes
    is left in: removing it is the verdict parser's business (stageb.verdicts), in one place."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut].strip()


def chat_messages(request, k: int) -> list[dict]:
    """The proposer's messages with the first ``k`` examples of a ``ChatRequest``."""
    user = "\n\n".join(p for p in [request.user_head, *request.examples[:k], request.user_tail] if p)
    return [{"role": "system", "content": request.system}, {"role": "user", "content": user}]


def fit_examples(request, encode) -> tuple[int, list[int], bool]:
    """``(k, prompt ids, fits)`` for the most examples, never below one, whose prompt fits
    (``contract.py``); ``fits`` False: the last try's. ``encode(messages)``: the prompt's ids."""
    limit = request.max_prompt_tokens
    lowest = 1 if request.examples else 0
    for k in range(len(request.examples), lowest - 1, -1):
        row = encode(chat_messages(request, k))
        if limit is None or len(row) <= limit:
            return k, row, True
    return lowest, row, False


def chunk_prompts(tokenizer, chunk, guidance: dict[str, str], profile,
                  encoder: PromptEncoder | None = None) -> tuple[list[list[int]], list[int]]:
    """The prompt ids of every ticket of ``chunk`` and the positions of those kept."""
    encoder = encoder or PromptEncoder(tokenizer)
    ids = encoder.encode([prompts.build_messages(profile, guidance, t) for t in chunk.tickets])
    return ids, kept_positions([len(row) for row in ids], chunk.max_prompt_tokens)


def kept_positions(prompt_tokens: list[int], limit: int | None) -> list[int]:
    """The positions whose prompt fits ``limit`` (None: no limit); the others are dropped."""
    return [i for i, n in enumerate(prompt_tokens) if limit is None or n <= limit]


# Stand-ins for a control token's spelling in data while the template renders: a private-use
# plane (U+F0000 on), which data almost never holds (a character it holds is skipped).
_STAND_IN_START = 0xF0000


class PromptEncoder:
    """The token ids of chat prompts whose message contents are data, for one tokenizer.

    A prompt whose data spells no control token (an added token, whitespace ones aside) is
    tokenized the template's way, in one call. One that does is rendered with a stand-in for
    each spelling, cut at the template's added tokens, and each piece, its data put back,
    tokenized by the tokenizer's pipeline without its added tokens (an added token's
    ``lstrip``/``rstrip`` is not reproduced: no tokenizer this project ships has one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        added = {t.content for t in tokenizer.added_tokens_decoder.values() if t.content}
        self.token_ids = {s: tokenizer.convert_tokens_to_ids(s) for s in added}
        # Longest first: at one position the longest spelling wins, as in the tokenizer.
        self.added = _alternatives(added)
        self.control = _alternatives(s for s in added if not s.isspace())

    def encode(self, conversations: list[list[dict]]) -> list[list[int]]:
        spelled = {i for i, messages in enumerate(conversations) if self._spells_a_control_token(messages)}
        clean = [render(self.tokenizer, m) for i, m in enumerate(conversations) if i not in spelled]
        out = self.tokenizer(clean, add_special_tokens=False)["input_ids"] if clean else []
        for i in sorted(spelled):  # ascending: every earlier conversation is in place
            out.insert(i, self._encode_spelled(conversations[i]))
        return out

    def _spells_a_control_token(self, messages: list[dict]) -> bool:
        return self.control is not None and any(self.control.search(m["content"]) for m in messages)

    def _encode_spelled(self, messages: list[dict]) -> list[int]:
        taken = {c for m in messages for c in m["content"]} | set(self.tokenizer.chat_template or "")
        spellings = sorted({s for m in messages for s in self.control.findall(m["content"])})
        stand_ins = (chr(c) for c in range(_STAND_IN_START, 0x10FFFE) if chr(c) not in taken)
        stand_in = dict(zip(spellings, stand_ins))
        restore = {ord(c): s for s, c in stand_in.items()}
        escaped = [dict(m, content=self.control.sub(lambda found: stand_in[found.group()], m["content"]))
                   for m in messages]
        text = render(self.tokenizer, escaped)
        ids, start = [], 0
        for found in self.added.finditer(text):
            ids += self._plain(text[start:found.start()].translate(restore))
            ids.append(self.token_ids[found.group()])
            start = found.end()
        return ids + self._plain(text[start:].translate(restore))

    def _plain(self, text: str) -> list[int]:
        """The ids of ``text`` as text: the tokenizer's pipeline without its added tokens."""
        if not text:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a Python tokenizer: transformers' own switch (special tokens only)
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


def _alternatives(spellings) -> re.Pattern | None:
    ordered = sorted(spellings, key=lambda s: (-len(s), s))
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


class Completion(NamedTuple):
    """One generated sample: ``ids`` up to and including the stop; ``"stop"`` or ``"length"``."""

    ticket: int
    decode: int
    sample: int
    ids: list[int]
    finish_reason: str


class ChatText:
    """The text side of an engine for one tokenizer. ``stop``: ``model.stop``. A stop string
    that is one token stops generation as a token (``stop_ids``); a longer one
    (``multi_token_stops``) is matched in the text; every completion is cut at the first."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.stop_strings = stop_strings(tokenizer, stop)
        self.stop_ids = [vocab[s] for s in self.stop_strings if s in vocab]
        self.multi_token_stops = [s for s in self.stop_strings if s not in vocab]
        self.encoder = PromptEncoder(tokenizer)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encoder.encode([messages])[0]

    def chunk_prompts(self, chunk, guidance: dict[str, str], profile) -> tuple[list[list[int]], list[int]]:
        return chunk_prompts(self.tokenizer, chunk, guidance, profile, self.encoder)

    def fit_examples(self, request) -> tuple[int, list[int], bool]:
        return fit_examples(request, self.prompt_ids)

    def texts(self, rows: list[list[int]]) -> list[str]:
        return [clean(t, self.stop_strings) for t in self.tokenizer.batch_decode(rows, skip_special_tokens=True)]

    def rollout_result(self, chunk, ids: list[list[int]], kept: list[int], completions: list[Completion],
                       started: float) -> ChunkResult:
        samples: list[list[Sample]] = [[] for _ in chunk.tickets]
        for c, text in zip(completions, self.texts([c.ids for c in completions])):
            samples[c.ticket].append(Sample(c.decode, c.sample, text, len(c.ids), c.finish_reason,
                                            c.ids if chunk.return_token_ids else None))
        return rollout_result(chunk, [len(row) for row in ids], kept, samples, started)

    def cut(self, row: list[int], pad_id: int) -> tuple[list[int], str]:
        """A transformers row up to and including its stop, and why it ended; after a stop
        string the row is padded, and trailing pads are not output."""
        for n, token in enumerate(row):
            if token in self.stop_ids:
                return row[: n + 1], "stop"
        if self.multi_token_stops:
            end = len(row)
            while end and row[end - 1] == pad_id:
                end -= 1
            text = self.tokenizer.decode(row[:end], skip_special_tokens=True)
            if any(s in text for s in self.multi_token_stops):
                return row[:end], "stop"
        return row, "length"


def rollout_result(chunk, prompt_tokens: list[int], kept: list[int], samples: list[list[Sample]],
                   started: float) -> ChunkResult:
    """A rollout chunk's result, tickets in chunk order. ``started``: ``perf_counter`` at the start."""
    kept_set = set(kept)
    tickets = [TicketRollout(t.key, prompt_tokens[i], dropped=i not in kept_set, samples=samples[i])
               for i, t in enumerate(chunk.tickets)]
    generated = sum(s.completion_tokens for ticket in samples for s in ticket)
    return ChunkResult(chunk.chunk_index, tickets, generated, time.perf_counter() - started)


def verdict_result(chunk, prompt_tokens: list[int], p_pass: dict[int, float], started: float) -> VerdictChunkResult:
    """A verdict chunk's result, tickets in chunk order; dropped where ``p_pass`` has no entry."""
    tickets = [TicketVerdictProbability(t.key, prompt_tokens[i], dropped=i not in p_pass, p_pass=p_pass.get(i))
               for i, t in enumerate(chunk.tickets)]
    return VerdictChunkResult(chunk.chunk_index, tickets, time.perf_counter() - started)
