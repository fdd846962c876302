"""Mission guidance (upstream 1.3; docs/formats.md section 2), its pure edits and its files.
``G0`` is the mission checklist (never removable), ``S*`` read-only, ``G1+`` learnable."""

from __future__ import annotations

import re
from datetime import datetime
from functools import cached_property
from pathlib import Path

import msgspec

from . import inputs
from .errors import InputError
from .hashing import content_hash
from .text import IndexTooLong, normalize_spaces, short, trailing_index

LEARNABLE_KEY = re.compile(r"^G\d+$")
SCAFFOLD_KEY = re.compile(r"^S\d+$")
PLACEHOLDER_G0 = "Initial guidance placeholder"
OPERATIONS = ("upsert", "update", "merge", "remove")
_SECTION_KEYS = ("step", "updated_at", "experiences", "metadata", "focus")


class GuidanceError(Exception):
    """An operation that cannot apply (no change, G0 removal, S* target, ...)."""


class ExperienceMeta(msgspec.Struct, forbid_unknown_fields=True):
    updated_at: str
    reflection_id: str
    sources: list[str] = []
    rationale: str | None = None
    hit_count: int = 0
    miss_count: int = 0
    confidence: float = 1.0


class Guidance(msgspec.Struct, dict=True):
    """Treated as immutable so its hash is computed once (``dict=True`` for the cached property)."""

    step: int
    updated_at: str
    experiences: dict[str, str]
    metadata: dict[str, ExperienceMeta] = {}

    @cached_property
    def hash(self) -> str:
        """What rollouts, the pool's shared values and artifact rows refer to: the rule texts only."""
        return content_hash(self.experiences)


class Operation(msgspec.Struct):
    op: str  # upsert | update | merge | remove
    key: str | None = None
    text: str | None = None
    rationale: str | None = None
    evidence: list[str] = []
    merged_from: list[str] = []


def _is_iso(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def _meta_from_raw(raw, where: str) -> ExperienceMeta:
    def bad(key: str, what: str):
        return InputError(what, f"{where}.{key}")

    if not isinstance(raw, dict):
        raise InputError("must be an object", where)
    for key in raw:
        if key not in ExperienceMeta.__struct_fields__:
            raise bad(key, "unknown field")
    if "updated_at" not in raw:
        raise bad("updated_at", "missing")
    if not _is_iso(raw["updated_at"]):
        raise bad("updated_at", "must be an ISO-8601 time string")
    if not isinstance(raw.get("reflection_id"), str) or not raw["reflection_id"].strip():
        raise bad("reflection_id", "missing" if "reflection_id" not in raw else "must be a non-empty string")
    sources = raw.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise bad("sources", "must be a list of strings")
    if raw.get("rationale") is not None and not isinstance(raw["rationale"], str):
        raise bad("rationale", "must be a string or null")
    for key in ("hit_count", "miss_count"):
        if key in raw and (type(raw[key]) is not int or raw[key] < 0):
            raise bad(key, "must be a non-negative integer")
    if "confidence" in raw and (isinstance(raw["confidence"], bool) or not isinstance(raw["confidence"], (int, float))):
        raise bad("confidence", "must be a number")
    return msgspec.convert(raw, ExperienceMeta)


def parse_section(raw, where: str) -> Guidance:
    if not isinstance(raw, dict):
        raise InputError("must be an object", where)
    if "version" in raw or "guidance" in raw:
        raise InputError("legacy schema (version + guidance) is not supported: use step, updated_at, experiences", where)
    for key in raw:
        if key not in _SECTION_KEYS:
            raise InputError(f"unknown field (expected {', '.join(_SECTION_KEYS[:4])})", f"{where}: {key}")
    step = raw.get("step")
    if "step" not in raw:
        raise InputError("missing", f"{where}: step")
    if type(step) is not int or step < 0:
        raise InputError(f"must be a non-negative integer, got {step!r}", f"{where}: step")
    if "updated_at" not in raw:
        raise InputError("missing", f"{where}: updated_at")
    if not _is_iso(raw["updated_at"]):
        raise InputError(f"must be an ISO-8601 time string, got {raw['updated_at']!r}", f"{where}: updated_at")
    experiences = raw.get("experiences")
    if "experiences" not in raw:
        raise InputError("missing", f"{where}: experiences")
    if not isinstance(experiences, dict) or not experiences:
        raise InputError("must be a non-empty object of rule texts", f"{where}: experiences")
    clean: dict[str, str] = {}
    for key, text in experiences.items():
        try:
            trailing_index(key)  # a prompt orders the rules by it
        except IndexTooLong as err:
            raise InputError(f"rule key too long: {err}", f"{where}: experiences.{short(key)}") from None
        if not isinstance(text, str) or not text.strip():
            raise InputError("must be a non-empty string", f"{where}: experiences.{key}")
        clean[key] = text.strip()
    focus = raw.get("focus")
    if focus is not None and not isinstance(focus, str):
        raise InputError("must be a string", f"{where}: focus")
    if focus and focus.strip() and clean.get("G0", PLACEHOLDER_G0) == PLACEHOLDER_G0:
        # Legacy files carried the checklist in `focus`; upstream promotes it into G0.
        clean = {"G0": focus.strip(), **{k: v for k, v in clean.items() if k != "G0"}}
    if "G0" not in clean:
        raise InputError("missing", f"{where}: experiences.G0")
    metadata_raw = raw.get("metadata", {})
    if not isinstance(metadata_raw, dict):
        raise InputError("must be an object", f"{where}: metadata")
    metadata = {k: _meta_from_raw(v, f"{where}: metadata.{k}") for k, v in metadata_raw.items()}
    return Guidance(step=step, updated_at=raw["updated_at"], experiences=clean, metadata=metadata)


def load_guidance(path: str | Path, mission: str) -> Guidance:
    data = inputs.load_json_file(path, "guidance file")
    if not isinstance(data, dict):
        raise InputError("must be a JSON object keyed by mission", str(path))
    if mission not in data:
        have = ", ".join(repr(m) for m in data) or "none"
        raise InputError(f"mission {mission!r} not in the guidance file; missions there: {have}", str(path))
    return parse_section(data[mission], f"{path}: {mission}")


def rule_text_key(text: str) -> str:
    """The form rule texts are compared in (upstream's duplicate lookup), never stored."""
    return normalize_spaces(text).strip().rstrip("。.")


def _check_learnable(key: str, role: str) -> None:
    if SCAFFOLD_KEY.match(key):
        raise GuidanceError(f"{role} {key} is a read-only scaffold rule")
    if not LEARNABLE_KEY.match(key):
        raise GuidanceError(f"{role} {key!r} is not a learnable rule key (G<n>)")


def _lowest_free_key(experiences: dict[str, str]) -> str:
    i = 1
    while f"G{i}" in experiences:
        i += 1
    return f"G{i}"


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _folded_meta(g: Guidance, keys: list[str], op: Operation, now: str, reflection_id: str) -> ExperienceMeta:
    """The written and merged keys' hits and misses folded plus one hit (upstream 1.3)."""
    old = [g.metadata[k] for k in keys if k in g.metadata]
    hits = sum(m.hit_count for m in old) + 1
    misses = sum(m.miss_count for m in old)
    rationale = (op.rationale or "").strip() or next((m.rationale for m in old if m.rationale), None)
    return ExperienceMeta(
        updated_at=now,
        reflection_id=reflection_id,
        sources=_dedupe(list(op.evidence) + [s for m in old for s in m.sources]),
        rationale=rationale,
        hit_count=hits,
        miss_count=misses,
        confidence=hits / (hits + misses + 1e-5),
    )


def _resolve_target(g: Guidance, op: Operation, text: str) -> str:
    if op.op == "upsert" and op.key is None:
        target = _lowest_free_key(g.experiences)
    elif op.key is None:
        raise GuidanceError(f"{op.op} needs a key")
    else:
        target = op.key
        _check_learnable(target, "target")
    if op.op == "update" and target not in g.experiences:
        raise GuidanceError(f"update target {target} does not exist")
    wanted = rule_text_key(text)
    for key, existing in g.experiences.items():
        if key != target and rule_text_key(existing) == wanted:
            if SCAFFOLD_KEY.match(key):
                raise GuidanceError(f"text duplicates read-only scaffold rule {key}")
            if LEARNABLE_KEY.match(key):
                return key  # identical rule already there: rewrite that key instead
    return target


def apply_operation(g: Guidance, op: Operation, *, now: str, reflection_id: str) -> Guidance:
    """Pure; a text an existing rule holds rewrites that rule, as upstream. Raises GuidanceError."""
    if op.op not in OPERATIONS:
        raise GuidanceError(f"unknown operation {op.op!r} (expected {', '.join(OPERATIONS)})")
    experiences = dict(g.experiences)
    metadata = dict(g.metadata)
    if op.op == "remove":
        if op.key is None:
            raise GuidanceError("remove needs a key")
        if op.key == "G0":
            raise GuidanceError("G0 (the mission checklist) cannot be removed")
        _check_learnable(op.key, "remove target")
        if op.key not in experiences:
            raise GuidanceError(f"remove {op.key} did not modify guidance (no such rule)")
        del experiences[op.key]
        metadata.pop(op.key, None)
    else:
        text = (op.text or "").strip()  # stored as given, as upstream
        if not rule_text_key(text):
            raise GuidanceError(f"{op.op} needs a non-empty text")
        target = _resolve_target(g, op, text)
        merged: list[str] = []
        if op.op == "merge":
            for key in _dedupe(list(op.merged_from)):
                if key == "G0":
                    raise GuidanceError("G0 (the mission checklist) cannot be merged away")
                _check_learnable(key, "merged_from")
                if key != target and key in experiences:
                    merged.append(key)
        experiences[target] = text
        for key in merged:
            del experiences[key]
            metadata.pop(key, None)
        metadata[target] = _folded_meta(g, [target, *merged], op, now, reflection_id)
    return Guidance(step=g.step + 1, updated_at=now, experiences=experiences, metadata=metadata)


def section_of(g: Guidance) -> dict:
    """What ``guidance.json`` holds per mission."""
    return msgspec.to_builtins(g)
