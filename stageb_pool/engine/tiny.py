"""The tiny test model (model path ``"tiny"``): a random Qwen2 and a byte-level BPE tokenizer
built in code, deterministically (a fixed corpus, a fixed seed), in milliseconds, so the whole
pipeline runs in tests for real. Its outputs are reproducible noise (``\\ufffd`` and control
characters included); ``initializer_range=0.3`` (not 0.02) makes greedy output depend on the
prompt instead of repeating one token.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# torch and transformers are imported inside the functions: the simulated engine counts
# tokens with ``build_bpe`` in every worker, and importing them costs seconds of CPU.

VOCAB_SIZE = 1024
CORPUS = [
    "You judge inspection tickets. Answer with two lines.",
    "Verdict: pass", "Verdict: fail", "Reason: the fire extinguisher is charged and sealed.",
    "Reason: the emergency exit is blocked by pallets.",
    "Ticket: handrail loose, bolts missing, reported by staff.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    # Prompt-like English and JSON, so the rendered Stage-B prompts of the tests take a few
    # hundred tokens instead of over a thousand (attention cost grows with the square).
    "You are a quality-control assistant for installation work. You receive text summaries of "
    "the photos of one job (you never see the photos) and decide whether the job as a whole "
    "passes or fails. Follow the rules in the user message. All rules must hold for a pass; "
    "a rule that cannot be confirmed from the summaries counts as not met. Ignore content that "
    "has nothing to do with the mission. If nothing supports a pass, answer fail.",
    "Answer with exactly two lines and nothing else (no blank lines, no JSON, no Markdown): "
    "Verdict: pass Reason: one line explaining the decision, at most 240 characters, without "
    "rule numbers. Use \"Verdict: fail\" instead of \"Verdict: pass\" when the job fails.",
    "Mission: Rooftop antenna mount inspection. Fixed rules: Rules: Image summaries: Statistics:",
    "1. If no photo shows the antenna mount, the verdict is fail. 2. Confirm that the mount is "
    "installed securely and completely, with all of its fittings in order.",
    '{"stats": [{"category": "antenna mount", "visibility": {"complete": 1}, "brand": {"Acme": 1}}], '
    '"notes": ["photo slightly blurry", "close-up", "partial view", "taken from below"]}',
    '{"category": "mounting bolt", "condition": {"tight": 6, "loose": 1, "missing": 2}}, '
    '{"category": "weatherproof seal", "condition": {"cracked": 1, "intact": 1, "peeling": 1}}, '
    '{"category": "grounding cable", "visibility": {"visible": 1}, "routing": {"slack": 1, "neat": 1}}, '
    '{"category": "label", "text": {"ANT-02": 1}}, {"category": "cable tie", "condition": {"fastened": 4}}',
    "A proposed rule edit: add, edit, remove or merge one rule of the guidance, with a rationale "
    "and the evidence (ticket keys) that supports it. Return a JSON object with candidates.",
]
SPECIALS = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_bpe() -> Tokenizer:
    """The bare byte-level BPE trained on ``CORPUS`` (deterministic per tokenizers version)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def build_tokenizer():
    """``build_bpe`` as a transformers tokenizer with a ChatML template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=build_bpe(),
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer, *, seed: int = 0, attn_implementation: str = "sdpa", heads: int = 4):
    """A 2-layer, hidden-64 Qwen2 whose weights depend only on ``seed``; head size 64 / ``heads``.
    The global torch RNG is restored afterwards: the caller's random numbers never shift."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=8192,
        initializer_range=0.3,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        attn_implementation=attn_implementation,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def build(*, seed: int = 0, attn_implementation: str = "sdpa"):
    """``(model, tokenizer)`` of the tiny test model, float32 on CPU."""
    tokenizer = build_tokenizer()
    return build_model(tokenizer, seed=seed, attn_implementation=attn_implementation), tokenizer
