"""``native`` weights of a GGUF checkpoint: its own Q8_0/Q4_0/Q4_1 blocks, bit for bit.

``native`` keeps a GGUF checkpoint's own blocks (``gguf.GGUFReader``) bit for bit: each
linear whose GGUF tensor is Q8_0/Q4_0/Q4_1 is stored as those bytes (row order mapped
through the q/k RoPE un-permutation transformers applies on load; blocks run along the
input dimension, so whole blocks move); tensors in other types fall back to bf16. The
pass checks that the blocks dequantize to exactly the weights the model holds.
"""

from __future__ import annotations

import re

import numpy as np

from nhil.errors import CompileError
from nhil.numerics.formats import GGML_TYPES, QTensor

_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_qk_row_order(n_rows: int, n_head: int) -> np.ndarray:
    """Row map of transformers' un-permutation of GGUF q/k weights: HF row r = GGUF row ``order[r]``.

    GGUF (llama.cpp ``convert_hf_to_gguf.py``) permutes q/k rows for interleaved RoPE;
    transformers' ``LlamaTensorProcessor._reverse_permute_weights`` undoes it by
    ``reshape(n_head, dim, 2).swapaxes(1, 2)`` with ``dim = rows / n_head / 2``; applied
    to the row indices it gives this map.
    """
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(n_rows)


def read_gguf_tensors(path) -> dict[str, tuple[int, np.ndarray, tuple[int, int]]]:
    """GGUF name -> (ggml type, raw block bytes uint8 [rows, row_bytes], (rows, K)) for 2-D tensors."""
    import gguf

    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        if len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF ne[0] = K (input dim, blocks run along it)
        out[t.name] = (int(t.tensor_type), np.asarray(t.data), (n, k))
    return out


def native_gguf_weights(path, model=None) -> dict[str, QTensor]:
    """HF parameter name -> QTensor of the GGUF file's Q8_0/Q4_0/Q4_1 blocks, rows in HF order.

    With ``model`` (the transformers model loaded from the same file) every tensor is
    checked: its blocks dequantize exactly to the model's fp32 weight.

    Raises:
        CompileError: the blocks do not reproduce the loaded weights.
    """
    cfg = getattr(model, "config", None)
    n_head = getattr(cfg, "num_attention_heads", None)
    n_kv = getattr(cfg, "num_key_value_heads", None)
    params = dict(model.named_parameters()) if model is not None else {}
    out: dict[str, QTensor] = {}
    for gname, (gtype, raw, (n, k)) in read_gguf_tensors(path).items():
        fmt = GGML_TYPES.get(gtype)
        if fmt is None:
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gname)
        if m and m.group(2) in _GGUF_TO_HF:
            names = [f"model.layers.{m.group(1)}.{_GGUF_TO_HF[m.group(2)]}.weight"]
        elif gname == "token_embd.weight":
            names = ["model.embed_tokens.weight", "lm_head.weight"]
        elif gname == "output.weight":
            names = ["lm_head.weight"]
        else:
            continue
        raw = raw.reshape(n, -1)
        if m and m.group(2) in ("attn_q", "attn_k") and n_head:
            heads = n_head if m.group(2) == "attn_q" else (n_kv or n_head)
            raw = raw[gguf_qk_row_order(n, heads)]
        qt = fmt.from_blocks(raw, n, k)
        qt.meta.update(gguf_name=gname, gguf_type=fmt.name)
        for hn in names:
            if hn in params:
                want = params[hn].detach().cpu().numpy()
                if want.shape != (n, k) or not np.array_equal(qt.dequantize(), want):
                    raise CompileError(f"GGUF tensor {gname} ({fmt.name}) does not dequantize to the loaded {hn}; the native blocks would not be the model's weights")
            out[hn] = qt
    return out
