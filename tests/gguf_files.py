"""Tiny llama GGUF files written with gguf-py, for the tests that load GGUFs (``test_from_path``, ``test_model_cache``).

The writer follows llama.cpp's ``convert_hf_to_gguf.py``: its tensor names (``gguf.get_tensor_name_map``), the q/k
row permutation (``LlamaModel.permute``), tied embeddings stored once as ``token_embd``. With ``tokenizer=True``
the file also carries a byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``: the 256 byte symbols of
GPT-2's ``bytes_to_unicode``, :data:`MERGES`, three control tokens), which transformers turns into a fast
tokenizer (``integrations/gguf/gguf_tokenizer_mapping.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def byte_level_tokens() -> list[str]:
    """The vocabulary :func:`write_gguf` stores: 256 byte symbols, one token per merge, then :data:`SPECIALS`."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)] + [a + b for a, b in MERGES] + SPECIALS


def tokenizer_vocab_size() -> int:
    """Token count of the vocabulary :func:`write_gguf` stores with ``tokenizer=True`` (the model's vocab_size must match)."""
    return 256 + len(MERGES) + len(SPECIALS)


def write_gguf(path: Path, model, tokenizer: bool = False) -> None:
    """A float32 llama GGUF of ``model`` (llama.cpp's q/k row permutation and tensor names); with ``tokenizer``, a byte-level BPE vocabulary too.

    Raises:
        ValueError: ``tokenizer`` asked for and ``model.config.vocab_size`` is not :func:`tokenizer_vocab_size`.
    """
    gguf = pytest.importorskip("gguf")
    c = model.config

    def permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    if tokenizer:
        if c.vocab_size != tokenizer_vocab_size():
            raise ValueError(f"the model's vocab_size is {c.vocab_size}; a GGUF with the test tokenizer needs {tokenizer_vocab_size()}")
        tokens = byte_level_tokens()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
        w.add_token_merges([f"{a} {b}" for a, b in MERGES])
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_unk_token_id(tokens.index("<|endoftext|>"))
        w.add_pad_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":  # tied: GGUF stores token_embd only
            continue
        a = v.detach().numpy().astype(np.float32)
        if k.endswith("q_proj.weight"):
            a = permute(a, c.num_attention_heads)
        elif k.endswith("k_proj.weight"):
            a = permute(a, c.num_key_value_heads)
        w.add_tensor(names.get_name(k, try_suffixes=(".weight", ".bias")), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
