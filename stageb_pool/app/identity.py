"""What a resumed rule search must match: the run's identity, kept in ``state.json``.

The resolved config without the keys that do not change a result (``NOT_IDENTITY``; the unused
engines' sections: ``registry.identity_model_section``), and the inputs by content, never by
path. docs/usage.md ("Resume") lists what is left out and why.
"""

from __future__ import annotations

from ..engine.registry import identity_model_section
from ..search.settings import RunIdentity
from ..stageb.hashing import content_hash, tickets_hash
from .config import config_document

NOT_IDENTITY = ("output", "pool.task_timeout", "pool.start_timeout", "pool.max_restarts", "pool.stall_warning",
                "pool.connect_timeout", "runner.epochs", "runner.speculate", "stage_b_distillation.log_chatml_path",
                "stage_a_paths", "ticket_filter.exclude_ticket_keys_path", "headroom")


def identity_document(config, *, seed_guidance, profile, proposer_system: str | None) -> dict:
    doc = config_document(config)
    for dotted in NOT_IDENTITY:
        *parents, key = dotted.split(".")
        node = doc
        for name in parents:
            node = node[name]
        node.pop(key, None)
    if doc["model"].get("gpus_per_worker") == 1:
        # left out so that runs made before GPU groups keep their identity
        doc["model"].pop("gpus_per_worker")
    doc["model"] = identity_model_section(doc["model"])
    doc["guidance"]["path"] = f"content:{content_hash(seed_guidance)}"
    doc["prompt"]["profile"] = f"content:{content_hash(profile)}"
    doc["rule_search"]["proposer_prompt_path"] = (
        f"content:{content_hash(proposer_system)}" if proposer_system is not None else None)
    return doc


def run_identity(config, inputs) -> RunIdentity:
    doc = identity_document(config, seed_guidance=inputs.seed_guidance, profile=inputs.profile,
                            proposer_system=inputs.proposer_system)
    return RunIdentity(config_hash=content_hash(doc), config=doc, tickets_hash=tickets_hash(inputs.tickets))
