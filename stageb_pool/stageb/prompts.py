"""Prompt profiles, the verdict prompt as data (upstream 2.1; docs/formats.md section 3): loaded
for one mission into a ``PromptProfile``, rendered per ticket by ``build_messages``."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from . import inputs
from .errors import InputError
from .hashing import content_hash
from .stations import station_summary_lines
from .summaries import estimate_objects, strip_summary_headers
from .text import MAX_INDEX_DIGITS, IndexTooLong, trailing_index, verdict_word_form

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"  # the built-in profiles (package data)
PROPOSER_FILE = "proposer.txt"  # a profile's default proposer system prompt
INLINE_FIELDS = ("mission", "focus")
BLOCK_FIELDS = ("scaffold", "rules", "image_stats", "station_summary", "image_summaries")
RULES_ORDERS = ("key", "g0_first")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class VerdictVocab(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Words accepted after ``Verdict:`` (compared by ``text.verdict_word_form``) and the two
    the prompt asks for. ``loose`` is off by default: upstream's grammar, so invalid rates compare."""

    pass_words: list[str]
    fail_words: list[str]
    pass_text: str
    fail_text: str
    loose: bool = False


class ProfileLabels(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Headings of the user-message blocks; ``image_stats`` is a template with ``{items}``, ``{count}``."""

    scaffold: str = "Fixed rules:"
    rules: str = "Rules:"
    image_stats: str = "Statistics: {items}; images: {count}"
    station_summary: str = "Install points (merged by station distance):"
    image_summaries: str = "Image summaries:"


class ProfileOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rules_order: str = "key"  # "key": by key string (G10 before G2, upstream); "g0_first": G0, then natural order
    object_stats: bool = False  # render the ImageN(obj=...) statistics line
    station_aggregation: bool = False  # render the RRU station-distance blocks (three RRU missions)
    bbu_cleanup: bool = False  # ingest: upstream's BBU summary clean-up for non-RRU missions


class ProfileFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):

    verdict: VerdictVocab
    language: str = "en"
    domain_prefixes: dict[str, str] = {}  # mission prefix -> domain (picks system_<domain>.txt)
    default_domain: str | None = None
    labels: ProfileLabels = ProfileLabels()
    options: ProfileOptions = ProfileOptions()


class PromptProfile(msgspec.Struct, frozen=True):

    name: str
    domain: str | None
    language: str
    system: str
    user_template: str
    verdict: VerdictVocab
    labels: ProfileLabels = ProfileLabels()
    options: ProfileOptions = ProfileOptions()

    @property
    def hash(self) -> str:
        return content_hash(self)


def _profile_dir(name_or_path: str, base_dir: str | Path | None) -> Path:
    is_name = "/" not in name_or_path and "\\" not in name_or_path and not name_or_path.startswith(".")
    directory = Path(base_dir or PROFILES_DIR) / name_or_path if is_name else Path(name_or_path)
    if not directory.is_dir():
        known = sorted(p.parent.name for p in Path(base_dir or PROFILES_DIR).glob("*/profile.yaml"))
        hint = f" (profiles there: {', '.join(known)})" if is_name and known else ""
        raise InputError(f"prompt profile not found{hint}", str(directory))
    return directory


def _read_text(path: Path, *, keep_final_newline: bool = False) -> str:
    """CRLF read as LF; a system text keeps its final newline (upstream's end with one)."""
    text = inputs.read_text(path, "profile file").replace("\r\n", "\n")
    if not text.strip():
        raise InputError("empty profile file", str(path))
    return text if keep_final_newline else text.rstrip("\n")


def _read_profile_yaml(path: Path) -> ProfileFile:
    raw = inputs.load_yaml_file(path, "profile file")
    if raw is None:
        raise InputError("empty profile file", str(path))
    try:
        profile = msgspec.convert(raw, ProfileFile)
    except msgspec.ValidationError as exc:
        message, _, keypath = str(exc).partition(" - at `$")
        keypath = keypath.rstrip("`").lstrip(".")
        raise InputError(message, f"{path}: {keypath}" if keypath else str(path)) from None
    if profile.options.rules_order not in RULES_ORDERS:
        raise InputError(f"must be one of {', '.join(RULES_ORDERS)}", f"{path}: options.rules_order")
    _check_vocabulary(profile.verdict, path)
    return profile


def _check_vocabulary(vocab: VerdictVocab, path: Path) -> None:
    if not vocab.pass_words or not vocab.fail_words:
        raise InputError("pass_words and fail_words must be non-empty", f"{path}: verdict")
    forms = {verdict_word_form(w, loose=vocab.loose): w for w in vocab.pass_words}
    both = [w for w in vocab.fail_words if verdict_word_form(w, loose=vocab.loose) in forms]
    if both:
        raise InputError(f"{both[0]!r} is both a pass word and a fail word", f"{path}: verdict.fail_words")


def _check_template(template: str, path: Path) -> None:
    known = INLINE_FIELDS + BLOCK_FIELDS
    for number, line in enumerate(template.split("\n"), start=1):
        for name in _PLACEHOLDER.findall(line):
            if name not in known:
                raise InputError(f"unknown placeholder {{{name}}}; known: {', '.join(known)}", f"{path}:{number}")


def resolve_domain(profile: ProfileFile, mission: str) -> str | None:
    for prefix, domain in profile.domain_prefixes.items():
        if mission.startswith(prefix):
            return domain
    return profile.default_domain


def load_profile(
    name_or_path: str, *, mission: str, base_dir: str | Path | None = None, domain: str | None = None
) -> PromptProfile:
    """A bare name under ``base_dir`` (default: the built-in profiles), else a directory."""
    directory = _profile_dir(str(name_or_path), base_dir)
    spec = _read_profile_yaml(directory / "profile.yaml")
    domain = domain or resolve_domain(spec, mission)
    system_path = directory / f"system_{domain}.txt" if domain else directory / "system.txt"
    if domain and not system_path.is_file() and (directory / "system.txt").is_file():
        system_path = directory / "system.txt"
    user_path = directory / "user.txt"
    user_template = _read_text(user_path)
    _check_template(user_template, user_path)
    return PromptProfile(
        name=directory.name,
        domain=domain,
        language=spec.language,
        system=_read_text(system_path, keep_final_newline=True),
        user_template=user_template,
        verdict=spec.verdict,
        labels=spec.labels,
        options=spec.options,
    )


def load_proposer_prompt(profile: str, path: str | None, *, base_dir: str | Path | None = None) -> str:
    file = Path(path) if path is not None else _profile_dir(str(profile), base_dir) / PROPOSER_FILE
    text = inputs.read_text(file, "proposer prompt")  # verbatim, as upstream (a BOM removed)
    if not text.strip():
        raise InputError("the proposer prompt is empty", str(file))
    return text


def _image_order(key: str) -> int:
    try:
        return trailing_index(key) or 0
    except IndexTooLong:
        return 0


def ordered_summaries(per_image: dict[str, str]) -> list[str]:
    """Summaries by the trailing integer of their key (none: 0; stable), as stored."""
    return [per_image[k] for k in sorted(per_image, key=_image_order)]


def _natural_key(key: str) -> tuple:
    m = re.fullmatch(r"([A-Za-z]*)([0-9]{1,%d})" % MAX_INDEX_DIGITS, key)
    return (m.group(1), int(m.group(2)), "") if m else (key, -1, key)


def _rule_lines(guidance: dict[str, str], prefix: str, order: str) -> list[str]:
    keys = [k for k in guidance if k.startswith(prefix)]
    if order == "key":
        keys.sort()
    else:
        keys.sort(key=lambda k: (k != "G0", _natural_key(k)))
    return [f"{i}. {guidance[k]}" for i, k in enumerate(keys, start=1)]


def _block(label: str, lines: list[str]) -> str:
    return "\n".join([label, *lines]) if lines else ""


def _blocks(profile: PromptProfile, guidance: dict[str, str], mission: str, summaries: list[str]) -> dict[str, str]:
    labels, options = profile.labels, profile.options
    values = {
        "mission": mission,
        "focus": guidance.get("G0") or mission,
        "scaffold": _block(labels.scaffold, _rule_lines(guidance, "S", options.rules_order)),
        "rules": _block(labels.rules, _rule_lines(guidance, "G", options.rules_order)),
        "image_stats": "",
        "station_summary": "",
        "image_summaries": _block(labels.image_summaries,
                                  [f"{i}. {strip_summary_headers(s)}" for i, s in enumerate(summaries, start=1)]),
    }
    if options.object_stats:
        items = ", ".join(f"Image{i}(obj={estimate_objects(s)})" for i, s in enumerate(summaries, start=1))
        values["image_stats"] = labels.image_stats.replace("{items}", items).replace("{count}", str(len(summaries)))
    if options.station_aggregation:
        values["station_summary"] = _block(labels.station_summary, station_summary_lines(mission, summaries))
    return values


def render_template(template: str, values: dict[str, str]) -> str:
    out: list[str] = []
    drop_blank = False
    for line in template.split("\n"):
        whole = _PLACEHOLDER.fullmatch(line.strip())
        if whole and whole.group(1) in BLOCK_FIELDS:
            block = values[whole.group(1)]
            drop_blank = not block
            if block:
                out.extend(block.split("\n"))
            continue
        if drop_blank and not line.strip():
            drop_blank = False
            continue
        drop_blank = False
        out.append(_PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), line))
    return "\n".join(out).strip("\n")


def build_messages(profile: PromptProfile, guidance: dict[str, str], ticket) -> list[dict]:
    """``ticket``: a TicketText, Ticket or dict; the label is never shown."""
    if not guidance:
        raise ValueError("guidance has no experiences: nothing to put in the prompt")
    mission = ticket["mission"] if isinstance(ticket, dict) else ticket.mission
    per_image = ticket["per_image"] if isinstance(ticket, dict) else ticket.per_image
    values = _blocks(profile, guidance, mission, ordered_summaries(per_image))
    return [
        {"role": "system", "content": profile.system},
        {"role": "user", "content": render_template(profile.user_template, values)},
    ]
