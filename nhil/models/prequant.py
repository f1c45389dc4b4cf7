"""Pre-quantized Hugging Face checkpoints: their ``quantization_config`` read, their tensors kept as shipped.

Two producers are understood (the ``quant_method`` of ``config.json``'s ``quantization_config``):

* ``compressed-tensors`` (llm-compressor's output; ``compressed_tensors`` 0.20 layouts,
  ``quantization_status: compressed``), per config group's ``weights`` args and ``format``:

  ============================  ==========================================  =============================
  scheme (format, weights)      checkpoint tensors of a linear              nhil format (exact)
  ============================  ==========================================  =============================
  pack-quantized int4 group G   weight_packed int32 [N, K/8] (nibble q+8,    ``int4-g<G>[-asym]`` (fp16
  (W4A16, sym / asym)           element 2i low), weight_scale [N, K/G],      scales) or ``-f32s`` (bf16 /
                                weight_zero_point int32 [N/8, K/G] (asym)    fp32 scales), G in 32/64/128
  int-quantized int8 channel /  weight int8 [N, K], weight_scale [N, 1] /    ``int8`` (fp32 row scale)
  tensor (W8A8, W8A16)          [1]
  float-quantized fp8 channel / weight float8_e4m3fn [N, K], weight_scale    ``fp8-e4m3`` (row scale) /
  tensor / block [bn, bk]       [N, 1] / [1] / [N/bn, K/bk]                  ``fp8-e4m3-b<bk>``
  nvfp4-pack-quantized          weight_packed uint8 [N, K/2], weight_scale   ``nvfp4-gs``
                                float8_e4m3fn [N, K/16], weight_global_scale
  ============================  ==========================================  =============================

* ``mxfp4`` (gpt-oss: transformers ``Mxfp4Config``): MoE experts' ``<proj>_blocks`` / ``_scales``
  -> ``mxfp4`` per expert (:func:`_read_mxfp4_experts`);
* ``fp8`` (transformers ``FineGrainedFP8Config``: DeepSeek-V3, Qwen3 FP8): ``weight``
  float8_e4m3fn [N, K] and ``weight_scale_inv`` [N/bn, K/bk] for ``weight_block_size [bn, bk]``
  -> ``fp8-e4m3-b<bk>``.

Codes are kept byte for byte (the nhil format's element codes are the checkpoint's bytes);
scales keep their values exactly (bf16/fp16 widen to fp32 without rounding; E4M3 block scales
are the same byte as UE4M3). The fp32 golden model is built by the producer's own
dequantization (``transformers`` with ``CompressedTensorsConfig(dequantize=True)`` /
``FineGrainedFP8Config(dequantize=True)``, i.e. compressed-tensors' ``decompress`` and
transformers' ``Fp8Dequantize``), never by nhil's; :func:`load_prequantized` then checks that
every native tensor's dequantization (rounded to the producer's compute dtype) equals it.

A scheme that nhil cannot hold exactly (int2/3/5/6/7, int8 groups, int4 channel-wise or group
sizes other than 32/64/128, asymmetric int8, fp8 groups, MX, sparsity, uncompressed status)
loads for its golden but is a :class:`NativeRefusal`: ``QUANT=native`` is then a COMPILE_FAIL
naming the scheme and the tensor. Activation schemes (``input_activations``): 8-bit symmetric
dynamic per-token ones (W8A8 int8, FP8_DYNAMIC) run the W8A8 MAC mode (``nhil.numerics.act_quant``,
``NativeWeights.act_mode``); others (FP8 per-token-group 128, static) keep bf16 activations and
the plan records them as ``activations_not_applied``.

Malformed checkpoints (a scale of the wrong shape or dtype, a group size that does not divide
K, a packed weight of the wrong width, an unknown ``quant_method`` or format) are a
:class:`nhil.errors.SetupError` naming the tensor.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from nhil.errors import SetupError
from nhil.numerics.formats import FP8_BLOCK, FP8_E4M3, INT4, INT4_F32S, INT8, NVFP4_GS, QTensor
from nhil.numerics.formats.base import f32_bytes

__all__ = ["NativeRefusal", "NativeWeights", "quant_config_of", "read_native", "load_dense_config"]


@dataclasses.dataclass
class NativeRefusal:
    """A checkpoint tensor ``QUANT=native`` cannot keep exactly: ``scheme`` (as the checkpoint names it) and why."""

    tensor: str
    scheme: str
    reason: str

    def message(self) -> str:
        return (f"QUANT=native: {self.tensor} is stored as {self.scheme}, which nhil cannot hold bit for bit ({self.reason}); "
                "nhil never re-quantizes a shipped checkpoint: use a format recipe (e.g. QUANT=int8) on its dequantized weights")


@dataclasses.dataclass
class NativeWeights:
    """The checkpoint's quantized linears, as nhil formats.

    Attributes:
        producer: ``compressed-tensors`` or ``fp8``.
        tensors: HF weight name (``model.layers.0.mlp.up_proj.weight``) -> QTensor holding the shipped codes.
        refused: HF weight name -> :class:`NativeRefusal` for tensors nhil cannot hold.
        schemes: HF weight name -> the checkpoint's scheme text.
        activations: scheme text of quantized input activations nhil does not apply (None: weight-only).
        dense_dtype: HF weight name -> torch dtype the producer dequantizes in (golden rounding).
    """

    producer: str
    tensors: dict[str, QTensor] = dataclasses.field(default_factory=dict)
    refused: dict[str, NativeRefusal] = dataclasses.field(default_factory=dict)
    schemes: dict[str, str] = dataclasses.field(default_factory=dict)
    activations: str | None = None
    act_mode: str | None = None
    views: dict[str, tuple[str, int, str]] = dataclasses.field(default_factory=dict)  # expert name -> (3-D param, expert, gate|up|down)
    dense_dtype: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)


def quant_config_of(cfg_path: Path) -> dict | None:
    """The ``quantization_config`` dict of a config.json, or None."""
    try:
        q = json.loads(cfg_path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return q if isinstance(q, dict) and q else None


class _Tensors:
    """Lazy reader over a folder's (sharded) safetensors files."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.where: dict[str, object] = {}
        for f in sorted(folder.glob("*.safetensors")):
            h = safe_open(str(f), "pt")
            for k in h.keys():
                self.where[k] = h

    def __contains__(self, k: str) -> bool:
        return k in self.where

    def get(self, k: str) -> torch.Tensor:
        return self.where[k].get_tensor(k)

    def prefixes(self, suffix: str) -> list[str]:
        return sorted(k[: -len(suffix)] for k in self.where if k.endswith(suffix))


def _bad(tensor: str, what: str, fix: str = "the checkpoint is corrupt or was written for another config") -> SetupError:
    return SetupError(f"pre-quantized checkpoint: {tensor}: {what}; {fix}")


def _expect_shape(name: str, t: torch.Tensor, shape: tuple, role: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise _bad(name, f"{role} has shape {list(t.shape)}, the scheme needs {list(shape)}")


def _scale_np(name: str, t: torch.Tensor) -> np.ndarray:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise _bad(name, f"scale dtype {t.dtype} is not fp32/bf16/fp16")
    s = t.to(torch.float32).numpy()  # widening: exact
    if not np.isfinite(s).all():
        raise _bad(name, "scale holds NaN or Inf")
    return s


def _nibbles(packed: torch.Tensor) -> np.ndarray:
    """int32 words (little-endian, 8 nibbles each, element 2i in the low nibble of byte i) -> uint8 [.., 8*words]."""
    raw = np.ascontiguousarray(packed.numpy()).view(np.uint8)
    return np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[0], -1)


# ------------------------------------------------------------------ compressed-tensors
def _ct_groups(qcfg: dict, where: Path):
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise SetupError(f"{where}: quantization_config (compressed-tensors) has no config_groups; the checkpoint's config is incomplete")
    return groups


def _ct_scheme_of(module: str, groups: dict, model_meta) -> tuple[str, dict] | None:
    from compressed_tensors.utils import is_match

    try:
        mod = model_meta.get_submodule(module)
    except AttributeError:
        return None
    for gname, g in groups.items():
        targets = g.get("targets") or []
        if any(is_match(module, mod, t) for t in targets):
            return gname, g
    return None


def _scheme_text(fmt: str, w: dict) -> str:
    parts = [f"{fmt}", f"{w.get('type')}{w.get('num_bits')}", str(w.get("strategy"))]
    if w.get("group_size"):
        parts.append(f"group {w['group_size']}")
    if w.get("block_structure"):
        parts.append(f"block {w['block_structure']}")
    parts.append("symmetric" if w.get("symmetric", True) else "asymmetric")
    return " ".join(parts)


def _act_text(a: dict | None) -> str | None:
    if not a:
        return None
    return f"{a.get('type')}{a.get('num_bits')} {a.get('strategy')}{' group ' + str(a['group_size']) if a.get('group_size') else ''} {'dynamic' if a.get('dynamic') else 'static'}"


def _act_mode(a: dict | None) -> str | None:
    """The W8A8 MAC mode (``nhil.numerics.act_quant``) of a compressed-tensors activation scheme nhil runs exactly:
    8-bit int or float, symmetric, dynamic, per token; None for any other (then the activations stay bf16, noted)."""
    if not a or a.get("num_bits") != 8 or not a.get("dynamic") or a.get("strategy") != "token" or not a.get("symmetric", True):
        return None
    return {"int": "int8", "float": "fp8"}.get(a.get("type"))


def _ct_one(name: str, fmt: str, w: dict, ts: _Tensors, n: int, k: int):
    """QTensor (or NativeRefusal) of one compressed-tensors linear ``name`` (``<module>.weight``) [n, k]."""
    p = name.removesuffix("weight")
    kind, bits, strat = w.get("type"), w.get("num_bits"), w.get("strategy")
    sym = w.get("symmetric", True)
    text = _scheme_text(fmt, w)
    refuse = lambda why: NativeRefusal(name, text, why)  # noqa: E731
    scale_t = ts.get(p + "weight_scale") if p + "weight_scale" in ts else None
    if scale_t is None:
        raise _bad(p + "weight_scale", "missing: every quantized linear needs its scale")
    if fmt == "pack-quantized":
        if kind != "int" or bits != 4:
            return refuse(f"only 4-bit packing has an nhil format (int4 groups); this is {kind}{bits}")
        g = w.get("group_size")
        if strat == "group" and (not isinstance(g, int) or g <= 0 or k % g):
            raise _bad(name, f"group size {g} does not divide K = {k}", "fix group_size in config.json's quantization_config")
        if strat != "group" or g not in (32, 64, 128):
            return refuse(f"nhil's int4 groups are 32/64/128 along K; this is strategy {strat}" + (f" group {g}" if g else ""))
        packed = ts.get(p + "weight_packed")
        _expect_shape(p + "weight_packed", packed, (n, -(-k // 8)), "packed int4 weight")
        _expect_shape(p + "weight_scale", scale_t, (n, k // g), "group scale")
        u = _nibbles(packed)[:, :k]
        s = _scale_np(p + "weight_scale", scale_t)
        zero = None
        if not sym:
            zt = ts.get(p + "weight_zero_point") if p + "weight_zero_point" in ts else None
            if zt is None:
                raise _bad(p + "weight_zero_point", "missing for an asymmetric scheme")
            _expect_shape(p + "weight_zero_point", zt, (-(-n // 8), k // g), "packed zero point")
            zero = _nibbles(zt.T.contiguous())[:, :n].T  # packed along the output dim (rows), 8 per int32
        if scale_t.dtype == torch.float16:  # the fp16 group scale of nhil's int4-g<G>: same bytes
            from nhil.numerics.formats.base import f16_bytes

            rec = f16_bytes(s) if sym else np.concatenate([f16_bytes(s), zero.astype(np.uint8)[..., None]], axis=-1)
            return INT4[(g, not sym)]._qtensor(np.zeros((n, 0)), rec, u.astype(np.uint8), (n, k))
        return INT4_F32S[(g, not sym)].from_fields(u, s, zero)  # bf16 / fp32 scales widened exactly
    if fmt in ("int-quantized", "naive-quantized", "float-quantized"):
        wt = ts.get(p + "weight")
        _expect_shape(p + "weight", wt, (n, k), "weight")
        if kind == "int":
            if bits != 8 or wt.dtype != torch.int8:
                return refuse(f"only int8 has an nhil format among the unpacked ints; this is int{bits} stored as {wt.dtype}")
            if not sym:
                return refuse("nhil's int8 is symmetric (no zero point)")
            if strat not in ("channel", "tensor"):
                return refuse(f"nhil's int8 has one scale per output row; this is strategy {strat}")
            s = _scale_np(p + "weight_scale", scale_t).reshape(-1)
            if s.size not in (1, n):
                raise _bad(p + "weight_scale", f"has {s.size} values, strategy {strat} needs {'1' if strat == 'tensor' else n}")
            row = np.broadcast_to(s, (n,)).astype(np.float32)
            return INT8._qtensor(f32_bytes(row), np.zeros((n, 0)), wt.numpy().view(np.uint8), (n, k), granularity=strat)
        if kind == "float":
            if bits != 8 or wt.dtype != torch.float8_e4m3fn:
                return refuse(f"only FP8 E4M3 has an nhil format among the unpacked floats; this is float{bits} stored as {wt.dtype}")
            codes = wt.view(torch.uint8).numpy()
            if strat in ("channel", "tensor"):
                s = _scale_np(p + "weight_scale", scale_t).reshape(-1)
                if s.size not in (1, n):
                    raise _bad(p + "weight_scale", f"has {s.size} values, strategy {strat} needs {'1' if strat == 'tensor' else n}")
                return FP8_E4M3._qtensor(f32_bytes(np.broadcast_to(s, (n,)).astype(np.float32)), np.zeros((n, 0)), codes, (n, k), granularity=strat)
            if strat == "block":
                return _fp8_block(name, text, codes, scale_t, p + "weight_scale", w.get("block_structure") or [], n, k)
            return refuse(f"nhil's FP8 formats have row, tensor or 2-D block scales; this is strategy {strat}")
        return refuse(f"weights of type {kind}")
    if fmt == "nvfp4-pack-quantized":
        if w.get("group_size") != 16 or kind != "float" or bits != 4:
            return refuse("nvfp4 in nhil is E2M1 with groups of 16")
        packed = ts.get(p + "weight_packed")
        _expect_shape(p + "weight_packed", packed, (n, k // 2), "packed E2M1 weight")
        if k % 16:
            raise _bad(name, f"group size 16 does not divide K = {k}")
        _expect_shape(p + "weight_scale", scale_t, (n, k // 16), "E4M3 block scale")
        if scale_t.dtype != torch.float8_e4m3fn:
            raise _bad(p + "weight_scale", f"dtype {scale_t.dtype}, NVFP4 block scales are float8_e4m3fn")
        sb = scale_t.view(torch.uint8).numpy()
        if (sb & 0x80).any():
            return refuse("a negative E4M3 block scale (UE4M3 has no sign)")
        gt = ts.get(p + "weight_global_scale") if p + "weight_global_scale" in ts else None
        if gt is None or gt.numel() != 1 or gt.dtype != torch.float32:
            raise _bad(p + "weight_global_scale", "missing, or not one fp32 value")
        raw = np.ascontiguousarray(packed.numpy())
        codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, k)
        return NVFP4_GS.from_fields(codes, sb, float(gt.reshape(()).item()))
    return refuse(f"compressed-tensors format {fmt!r} has no nhil format")


def _fp8_block(name, text, codes, scale_t, scale_name, block, n, k):
    if len(block) != 2:
        raise _bad(name, f"block FP8 needs a [rows, cols] block size, the config gives {block!r}")
    bn, bk = (int(x) for x in block)
    if bk not in FP8_BLOCK:
        return NativeRefusal(name, text, f"nhil's FP8 block formats have {sorted(FP8_BLOCK)}-element blocks along K, this has {bk}")
    _expect_shape(scale_name, scale_t, (-(-n // bn), -(-k // bk)), f"block scale for blocks {bn}x{bk}")
    return FP8_BLOCK[bk].from_fields(codes, _scale_np(scale_name, scale_t), bn)


# ------------------------------------------------------------------ entry
def _linear_shapes(model_meta) -> dict[str, tuple[int, int]]:
    return {f"{m}.weight": (mod.out_features, mod.in_features) for m, mod in model_meta.named_modules() if isinstance(mod, torch.nn.Linear)}


def read_native(folder: Path, qcfg: dict, config) -> NativeWeights:
    """The checkpoint's quantized linears as nhil formats (module docstring).

    Args:
        folder: the Hugging Face folder.
        qcfg: its ``quantization_config``.
        config: the transformers config (the model is built on the meta device to find the linears).
    Raises:
        SetupError: unknown ``quant_method``/format, or a malformed tensor (named).
    """
    from transformers import AutoModelForCausalLM

    method = qcfg.get("quant_method")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    shapes = _linear_shapes(meta)
    ts = _Tensors(folder)
    out = NativeWeights(producer=str(method))
    if method == "compressed-tensors":
        groups = _ct_groups(qcfg, folder / "config.json")
        status = qcfg.get("quantization_status")
        for name, (n, k) in shapes.items():
            p = name.removesuffix("weight")
            if p + "weight_scale" not in ts:
                continue
            hit = _ct_scheme_of(p.rstrip("."), groups, meta)
            if hit is None:
                raise _bad(p + "weight_scale", "has a scale but no config group targets this module")
            _, g = hit
            fmt = g.get("format") or qcfg.get("format") or "dense"
            w = g.get("weights") or {}
            out.schemes[name] = _scheme_text(fmt, w)
            out.activations = out.activations or _act_text(g.get("input_activations"))
            out.act_mode = out.act_mode or _act_mode(g.get("input_activations"))
            if status != "compressed":
                out.refused[name] = NativeRefusal(name, out.schemes[name], f"quantization_status is {status!r}: the weights are stored dense, not as codes")
                continue
            r = _ct_one(name, fmt, w, ts, n, k)
            (out.refused if isinstance(r, NativeRefusal) else out.tensors)[name] = r
    elif method == "fp8":
        block = qcfg.get("weight_block_size")
        if qcfg.get("fmt", "e4m3") != "e4m3":
            raise SetupError(f"{folder}: quant_method fp8 with fmt {qcfg.get('fmt')!r}; nhil reads E4M3 FP8 checkpoints")
        if qcfg.get("activation_scheme") not in (None, "dynamic", "static"):
            raise SetupError(f"{folder}: quant_method fp8 with unknown activation_scheme {qcfg.get('activation_scheme')!r}")
        out.activations = f"fp8 e4m3 {qcfg.get('activation_scheme', 'dynamic')} per-token group {block[1] if block else 'tensor'}"
        text = f"fp8 e4m3 weight_block_size {block}"
        for name, (n, k) in shapes.items():
            sname = name.removesuffix("weight") + "weight_scale_inv"
            if sname not in ts:
                continue
            wt = ts.get(name)
            if wt.dtype != torch.float8_e4m3fn:
                raise _bad(name, f"dtype {wt.dtype}; quant_method fp8 stores float8_e4m3fn weights")
            _expect_shape(name, wt, (n, k), "weight")
            out.schemes[name] = text
            if block is None:
                r = FP8_E4M3._qtensor(f32_bytes(np.full(n, _scale_np(sname, ts.get(sname)).reshape(-1)[0], np.float32)), np.zeros((n, 0)),
                                      wt.view(torch.uint8).numpy(), (n, k), granularity="tensor")
            else:
                r = _fp8_block(name, text, wt.view(torch.uint8).numpy(), ts.get(sname), sname, block, n, k)
            (out.refused if isinstance(r, NativeRefusal) else out.tensors)[name] = r
    elif method == "mxfp4":
        _read_mxfp4_experts(ts, out, shapes_3d=_expert_shapes(meta))
    else:
        raise SetupError(f"{folder}: quantization_config quant_method {method!r} is not one nhil reads (compressed-tensors, fp8, mxfp4); "
                         "convert the checkpoint with llm-compressor, or dequantize it to a plain safetensors folder")
    if not out.schemes:
        raise SetupError(f"{folder}: quantization_config says {method} but no tensor of the checkpoint carries its scales; the checkpoint is not the one the config describes")
    return out


def _expert_shapes(model_meta) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model_meta.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj")) and p.dim() == 3}


def _read_mxfp4_experts(ts: _Tensors, out: NativeWeights, shapes_3d: dict) -> None:
    """gpt-oss' MXFP4 experts (transformers ``quant_method: mxfp4``): ``<p>_blocks`` uint8 [E, out, in/32, 16] of E2M1
    nibbles (element 2i low, transformers ``convert_moe_packed_tensors``), ``<p>_scales`` uint8 [E, out, in/32] E8M0
    -> nhil ``mxfp4`` per expert, under the lowered names (``lower_moe``): ``<gate_up>.<e>.gate`` (rows 0::2),
    ``.up`` (rows 1::2), ``<down>.<e>``."""
    from nhil.numerics.formats import MXFP4

    for pname, (e_count, k_in, n_out) in shapes_3d.items():  # transformers' gpt-oss params are [E, in, out]
        bname, sname = pname + "_blocks", pname + "_scales"
        if bname not in ts:
            continue
        blocks, scales = ts.get(bname), ts.get(sname) if sname in ts else None
        if scales is None:
            raise _bad(sname, "missing: MXFP4 blocks need their E8M0 scales")
        _expect_shape(bname, blocks, (e_count, n_out, k_in // 32, 16), "MXFP4 blocks")
        _expect_shape(sname, scales, (e_count, n_out, k_in // 32), "E8M0 scales")
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise _bad(bname, f"dtypes {blocks.dtype}/{scales.dtype}; gpt-oss MXFP4 stores uint8 blocks and scales")
        raw = blocks.numpy()
        codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(e_count, n_out, k_in)
        sc = scales.numpy()
        for e in range(e_count):
            parts = {f"{pname}.{e}.gate": slice(0, None, 2), f"{pname}.{e}.up": slice(1, None, 2)} if pname.endswith("gate_up_proj") else {f"{pname}.{e}": slice(None)}
            for name, rows in parts.items():
                c, r = codes[e, rows], sc[e, rows]
                out.tensors[name] = MXFP4._qtensor(np.zeros((c.shape[0], 0)), r[..., None], c.astype(np.uint8), c.shape)
                out.schemes[name] = "mxfp4 (gpt-oss experts, E2M1 + E8M0 per 32)"
                out.views[name] = (pname, e, "gate" if name.endswith(".gate") else "up" if name.endswith(".up") else "down")


def load_dense_config(qcfg: dict):
    """The transformers quantization config that dequantizes this checkpoint on load (its producer's code)."""
    method = qcfg.get("quant_method")
    if method == "compressed-tensors":
        try:
            import compressed_tensors  # noqa: F401
        except ImportError:
            raise SetupError("this checkpoint is in compressed-tensors format: pip install 'nhil[prequant]' (compressed-tensors==0.20.*)") from None
        from transformers import CompressedTensorsConfig

        return CompressedTensorsConfig(dequantize=True)
    if method == "mxfp4":
        from transformers import Mxfp4Config

        return Mxfp4Config(dequantize=True, modules_to_not_convert=qcfg.get("modules_to_not_convert"))
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config(weight_block_size=qcfg.get("weight_block_size"), activation_scheme=qcfg.get("activation_scheme", "dynamic"), dequantize=True)


def check_against_dense(native: NativeWeights, model) -> None:
    """Every native tensor, dequantized by nhil and rounded to the dense weight's dtype... equals the producer's
    dequantization held by ``model`` (fp32; compressed-tensors computes in the scale's dtype, so its result is
    compared after rounding nhil's fp32 value to that dtype's precision).

    Raises:
        SetupError: a tensor whose shipped codes do not reproduce the producer's weights (names it).
    """
    params = dict(model.named_parameters())
    for name, qt in native.tensors.items():
        if name in native.views:  # an MoE expert slice of a 3-D [E, in, out] parameter
            pn, e, part = native.views[name]
            w = params[pn][e].detach().to(torch.float32)
            want = {"gate": w[:, 0::2], "up": w[:, 1::2], "down": w}[part].t().contiguous()
        else:
            want = params[name].detach().to(torch.float32)
        mine = torch.from_numpy(qt.dequantize())
        if torch.equal(mine, want):
            continue
        for dt in (torch.bfloat16, torch.float16):
            if torch.equal(mine.to(dt).to(torch.float32), want):
                native.dense_dtype[name] = dt
                break
        else:
            bad = int((mine != want).sum())
            raise SetupError(f"pre-quantized checkpoint: {name}: nhil's reading of the shipped codes differs from the producer's dequantization "
                             f"in {bad} of {want.numel()} weights; nhil's mapping of {native.schemes.get(name)} is wrong for this checkpoint")
