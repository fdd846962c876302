"""The two-line verdict protocol, the majority vote and the metrics (upstream 2.3 and 2.4;
docs/formats.md sections 4-5). Positive class is "pass": fp is a GT-fail ticket let through."""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Iterable

import msgspec

from .prompts import VerdictVocab
from .text import verdict_word_form

# Only *leading* role echoes are removed; upstream also cut at the last "assistant" anywhere,
# which made any Reason using the word invalid (upstream 9.3 item 10).
_ASSISTANT_MARKER = re.compile(r"^\s*(?:<\|?im_start\|?>)?(?:assistant|Assistant)(?:[ \t]*:)?")
_COLON = re.compile(r"[:：]")


class Parsed(msgspec.Struct, frozen=True):
    """One candidate: ``verdict`` "pass" | "fail", or None with ``error`` saying why (logs only)."""

    verdict: str | None
    reason: str | None
    error: str | None = None


def _invalid(error: str) -> Parsed:
    return Parsed(None, None, error)


def strip_assistant_marker(text: str) -> str:
    """The one place a role echo is removed (the engine returns the decoded text as is)."""
    while True:
        m = _ASSISTANT_MARKER.match(text)
        if not m:
            return text
        text = text[m.end():]


def _split_field(line: str) -> str | None:
    m = _COLON.search(line)
    return None if m is None else line[m.end():].strip()


@functools.lru_cache(maxsize=64)
def _word_forms(words: tuple[str, ...], loose: bool) -> frozenset[str]:
    return frozenset(verdict_word_form(w, loose=loose) for w in words)


def parse_verdict(text: str | None, vocab: VerdictVocab) -> Parsed:
    """``Verdict: <word>`` / ``Reason: <text>`` in exactly two non-empty lines, else invalid."""
    if text is None:
        return _invalid("no text")
    body = strip_assistant_marker(text.strip()).strip()
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    if len(lines) != 2:
        return _invalid(f"expected 2 non-empty lines, got {len(lines)}")
    verdict_line, reason_line = lines
    if not verdict_line.lower().startswith("verdict"):
        return _invalid("line 1 does not start with 'Verdict'")
    if not reason_line.lower().startswith("reason"):
        return _invalid("line 2 does not start with 'Reason'")
    value = _split_field(verdict_line)
    reason = _split_field(reason_line)
    if value is None:
        return _invalid("no ':' after 'Verdict'")
    if reason is None:
        return _invalid("no ':' after 'Reason'")
    loose = vocab.loose
    word = verdict_word_form(value, loose=loose)
    if word in _word_forms(tuple(vocab.pass_words), loose):
        verdict = "pass"
    elif word in _word_forms(tuple(vocab.fail_words), loose):
        verdict = "fail"
    else:
        return _invalid(f"unknown verdict {value!r}")
    if not reason:
        return _invalid("empty reason")
    return Parsed(verdict, reason)


class TicketTally:
    """``ticket_stats`` of a ticket's answers, each distinct (ticket, label, answers) tallied
    once and each distinct answer parsed once: a baseline and its candidates mostly get the
    same answers for a ticket, and parsing and voting are the parent's main cost per ticket.
    Each memo starts over past ``limit`` entries."""

    def __init__(self, vocab: VerdictVocab, limit: int = 100_000):
        self.vocab, self.limit = vocab, limit
        self._parsed: dict[str, Parsed] = {}
        self._stats: dict[tuple[str, str, tuple[str, ...]], TicketStats] = {}

    def stats(self, key: str, gt_label: str, texts: tuple[str, ...]) -> TicketStats:
        memo_key = (key, gt_label, texts)
        stats = self._stats.get(memo_key)
        if stats is None:
            if len(self._stats) >= self.limit:
                self._stats.clear()
            stats = self._stats[memo_key] = ticket_stats(key, gt_label, [self._parse(text) for text in texts])
        return stats

    def _parse(self, text: str) -> Parsed:
        parsed = self._parsed.get(text)
        if parsed is None:
            if len(self._parsed) >= self.limit:
                self._parsed.clear()
            parsed = self._parsed[text] = parse_verdict(text, self.vocab)
        return parsed


class TicketStats(msgspec.Struct, frozen=True):  # frozen: a TicketTally hands the same one to many rollouts
    """The vote of one ticket's candidates (upstream ``build_ticket_stats``)."""

    key: str
    gt_label: str
    majority: str | None
    pass_count: int
    fail_count: int
    invalid_count: int
    total_samples: int
    agreement: float
    difficulty: float
    hard_wrong: float
    verdicts: list[str | None]
    reasons: list[str | None]

    @property
    def correct(self) -> bool:
        return self.majority == self.gt_label


def ticket_stats(key: str, gt_label: str, parsed: list[Parsed]) -> TicketStats:
    """Majority vote, fail on ties, invalid samples do not vote; no valid sample -> None."""
    verdicts = [p.verdict for p in parsed]
    n_pass = verdicts.count("pass")
    n_fail = verdicts.count("fail")
    voting = n_pass + n_fail
    if voting == 0:
        majority, agreement, difficulty = None, 0.0, 0.5
    else:
        majority = "pass" if n_pass > n_fail else "fail"
        agreement = max(n_pass, n_fail) / voting
        difficulty = 1.0 - agreement
    hard_wrong = agreement if majority is not None and majority != gt_label else 0.0
    return TicketStats(
        key=key,
        gt_label=gt_label,
        majority=majority,
        pass_count=n_pass,
        fail_count=n_fail,
        invalid_count=len(parsed) - voting,
        total_samples=len(parsed),
        agreement=agreement,
        difficulty=difficulty,
        hard_wrong=hard_wrong,
        verdicts=verdicts,
        reasons=[p.reason for p in parsed],
    )


class Metrics(msgspec.Struct):
    """Ticket-level metrics; rates over all ``n``. An infinite ratio is None (upstream wrote ``Infinity``)."""

    n: int
    acc: float
    tp: int
    fp: int
    fn: int
    tn: int
    fn_rate: float
    fp_rate: float
    fn_over_tp: float | None
    fp_over_tp: float | None
    false_release_rate: float
    false_block_rate: float


def _ratio(num: int, den: int) -> float | None:
    if den:
        return num / den
    return None if num else 0.0


def _share(num: int, den: int) -> float:
    return num / den if den else 0.0


def compute_metrics(stats: Iterable[TicketStats] | dict[str, TicketStats]) -> Metrics:
    """An invalid (None) majority is always an error: fp for GT fail, fn for GT pass."""
    rows = list(stats.values()) if isinstance(stats, dict) else list(stats)
    n = len(rows)
    tp = sum(1 for s in rows if s.gt_label == "pass" and s.majority == "pass")
    fn = sum(1 for s in rows if s.gt_label == "pass" and s.majority != "pass")
    tn = sum(1 for s in rows if s.gt_label == "fail" and s.majority == "fail")
    fp = sum(1 for s in rows if s.gt_label == "fail" and s.majority != "fail")
    return Metrics(
        n=n,
        acc=_share(tp + tn, n),  # labels are pass or fail, so the correct tickets are tp + tn
        tp=tp,
        fp=fp,
        fn=fn,
        tn=tn,
        fn_rate=_share(fn, n),
        fp_rate=_share(fp, n),
        fn_over_tp=_ratio(fn, tp),
        fp_over_tp=_ratio(fp, tp),
        false_release_rate=_share(fp, tp + fp),
        false_block_rate=_share(fn, tp + fn),
    )


def _most_common(values: list[str]) -> list[tuple[str, int]]:
    # Ties go to the reason seen first (Counter keeps insertion order, sorted() is stable).
    return sorted(Counter(values).items(), key=lambda kv: -kv[1])


def _majority_voters_reasons(stats: TicketStats) -> list[str]:
    if stats.majority is None:
        return []
    return [r for v, r in zip(stats.verdicts, stats.reasons) if v == stats.majority and r]


def majority_reason(stats: TicketStats) -> str | None:
    reasons = _majority_voters_reasons(stats)
    return _most_common(reasons)[0][0] if reasons else None


def reason_counts(stats: TicketStats, top: int = 5) -> list[dict]:
    return [{"reason": r, "count": c} for r, c in _most_common(_majority_voters_reasons(stats))[:top]]
