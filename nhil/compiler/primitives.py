"""nhil graph-IR primitives (``torch.ops.nhil.*``), registered with ``torch.library``: importing this module
registers all of them.

Each primitive has a *reference kernel*, which is its numerics definition, and a *fake
kernel* (shapes/dtypes only, for ``FakeTensorProp`` and export). The reference kernels
use the same torch ops in the same order as transformers 5.24's Llama code
(``transformers/models/llama/modeling_llama.py``, ``integrations/sdpa_attention.py``,
``masking_utils.py``; GPT-2's ``modeling_gpt2.py``, ``pytorch_utils.Conv1D`` and
``activations.NewGELUActivation`` for ``layer_norm`` / ``gelu`` / ``pos_embedding`` and the
Conv1D ``linear``) as they appear in the exported ATen graph, so a raised graph is
bit-identical to the exported one.

One module a concern, all defined in the one library of ``primitives_lib`` (with the layout
convention: token-major ``[B, S, features]``, multi-head tensors flat, fp32):

* ``primitives_dense``: embedding, pos_embedding, linear, narrow, add, gelu, gelu_mul, silu_mul, softcap;
* ``primitives_norm``: rms_norm, layer_norm;
* ``primitives_rope``: rope_cos_sin, rope (and DeepSeek's interleaved form);
* ``primitives_attention``: attention_kv, attention, attention_scores, attention_values;
* ``primitives_moe``: moe, moe_experts;
* ``primitives_mla``: mla_kv, mla;
* ``primitives_recurrent``: causal_conv1d_update, ssm_state_update, rms_norm_gated, concat, gated_delta_rule.

The names below are re-exported, so ``from nhil.compiler.primitives import moe_routing`` keeps working.
"""

from __future__ import annotations

from nhil.compiler import (
    primitives_attention,
    primitives_dense,
    primitives_mla,
    primitives_moe,
    primitives_norm,
    primitives_recurrent,
    primitives_rope,
)
from nhil.compiler.primitives_attention import attention_kv_ref, attention_ref, visible_mask
from nhil.compiler.primitives_dense import (
    GELU_VARIANTS,
    add_ref,
    embedding_ref,
    gelu_mul_ref,
    gelu_ref,
    linear_ref,
    narrow_ref,
    pos_embedding_ref,
    silu_mul_ref,
    softcap_ref,
)
from nhil.compiler.primitives_lib import LIB
from nhil.compiler.primitives_mla import mla_kv_ref, mla_ref, mla_rope_parts
from nhil.compiler.primitives_moe import (
    MOE_ACTS,
    MOE_LAYOUTS,
    MOE_SCORE_FUNCS,
    moe_expert_ffn,
    moe_expert_ffn_gpt_oss,
    moe_ref,
    moe_routing,
    moe_shared_expert,
    swiglu_clamp,
)
from nhil.compiler.primitives_norm import layer_norm_ref, rms_norm_ref
from nhil.compiler.primitives_rope import ROPE_STYLES, rope_cos_sin_ref, rope_interleave, rope_ref

#: every ``nhil::*`` op name, module by module
PRIMITIVES: tuple[str, ...] = (
    primitives_dense.PRIMITIVES + primitives_norm.PRIMITIVES + primitives_rope.PRIMITIVES + primitives_attention.PRIMITIVES
    + primitives_moe.PRIMITIVES + primitives_mla.PRIMITIVES + primitives_recurrent.PRIMITIVES
)

__all__ = [
    "GELU_VARIANTS", "LIB", "MOE_ACTS", "MOE_LAYOUTS", "MOE_SCORE_FUNCS", "PRIMITIVES", "ROPE_STYLES",
    "add_ref", "attention_kv_ref", "attention_ref", "embedding_ref", "gelu_mul_ref", "gelu_ref", "layer_norm_ref",
    "linear_ref", "mla_kv_ref", "mla_ref", "mla_rope_parts", "moe_expert_ffn", "moe_expert_ffn_gpt_oss", "moe_ref",
    "moe_routing", "moe_shared_expert", "narrow_ref", "pos_embedding_ref", "rms_norm_ref", "rope_cos_sin_ref",
    "rope_interleave", "rope_ref", "silu_mul_ref", "softcap_ref", "swiglu_clamp", "visible_mask",
]
