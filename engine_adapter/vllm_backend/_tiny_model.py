"""A random-weight Llama-architecture model and a locally trained tokenizer, built without any hub access.

Why: tests and replays need a real vLLM serving a real model, and no model hub is reachable here (nor in
CI). The architecture is the ordinary ``LlamaForCausalLM`` vLLM serves everywhere, only tiny (hidden 256,
4 layers), so prefill and decode cost is dominated by the engine's own scheduling, which is what hintflow
changes. Its outputs are noise; its KV cache, prefix hashing and memory pressure are real.

Needs ``transformers`` and ``tokenizers`` (both come with vLLM), imported inside the function so that
this module imports, and type-checks, where they are absent.
"""

from __future__ import annotations

import string
from pathlib import Path

__all__ = ["make_tiny_model"]

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _corpus(n_lines: int = 2000) -> list[str]:
    """Deterministic text for BPE training: words, code-ish lines, digits; enough merges for 1K tokens."""
    words = [
        "the", "agent", "tool", "call", "result", "file", "read", "write", "error", "def", "return",
        "import", "class", "self", "value", "cache", "block", "token", "prompt", "turn", "program",
    ]
    lines = []
    for i in range(n_lines):
        w = [words[(i * 7 + k * 3) % len(words)] for k in range(8)]
        lines.append(f"{' '.join(w)} {i} {string.ascii_letters[i % 52]}=({i % 97}) -> {w[0]}.{w[1]}()")
    return lines


def make_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    vocab_size: int = 1024,
    max_position_embeddings: int = 16384,
    seed: int = 0,
) -> Path:
    """Write config, random weights (safetensors) and tokenizer to ``out_dir``; return the folder.

    Deterministic for a given ``seed``, so two builds serve the same model (same prefix hashes).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = ["<s>", "</s>", "<unk>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.model_max_length = max_position_embeddings
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    import sys

    print(make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
