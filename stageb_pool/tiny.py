"""The tiny test model (model path ``"tiny"``): a random Qwen2 and a byte-level BPE tokenizer
built in code, deterministically, in milliseconds, with nothing downloaded.

It exists so the whole pipeline (pool, engine, rollouts, search) runs in tests for real.
Its outputs are noise, but reproducible noise: the BPE training corpus is fixed and the
weights are drawn from a fixed seed. ``initializer_range=0.3`` (not the usual 0.02) so that
greedy output depends on the prompt instead of repeating one token for every input.
Byte-level decoding of random tokens can give ``\\ufffd`` and control characters.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never touch a hub

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

NAME = "tiny-qwen2"
VOCAB_SIZE = 320
CORPUS = [
    "You judge inspection tickets. Answer with two lines.",
    "Verdict: pass",
    "Verdict: fail",
    "Reason: the fire extinguisher is charged and sealed.",
    "Reason: the emergency exit is blocked by pallets.",
    "Ticket: handrail loose, bolts missing, reported by staff.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]
SPECIALS = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``CORPUS`` (deterministic for a fixed tokenizers version),
    ChatML chat template, left padding, eos ``<|im_end|>``."""
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
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer, *, seed: int = 0, attn_implementation: str = "sdpa") -> Qwen2ForCausalLM:
    """A 2-layer, hidden-64 Qwen2 whose weights depend only on ``seed``.

    The global torch RNG is saved and restored around construction, so building the model
    never shifts the random numbers of the caller (the rollout seeds).
    """
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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
