"""Tiny pre-quantized checkpoints written by compressed-tensors' own code (test helper, no hub access).

``write_ct_checkpoint(folder, scheme)`` builds the seeded ``llama-tiny`` model, attaches a
compressed-tensors ``QuantizationConfig`` (``apply_quantization_config``), computes every
linear's scale / zero point / global scale with compressed-tensors' ``calculate_qparams`` /
``generate_gparam`` over its weight (min-max observer, as llm-compressor's default
``memoryless_minmax``), compresses with ``ModelCompressor.compress_model`` and saves with
``save_pretrained`` + ``ModelCompressor.update_config`` — the path llm-compressor's
``oneshot`` takes after calibration. ``write_fp8_block_checkpoint`` writes transformers'
``quant_method: fp8`` layout (DeepSeek-V3 / Qwen3 FP8: ``weight`` in float8_e4m3fn,
``weight_scale_inv`` fp32 per 128x128 block) by hand from the published layout; the loader
cross-checks it against transformers' own dequantization.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SCHEMES = {
    # name: (format, weights QuantizationArgs kwargs, input_activations kwargs or None)
    "w4a16": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32), None),
    "w4a16-asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64), None),
    "w8a8": ("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
             dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),
    "fp8-block": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 32]), None),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel"), None),
    "nvfp4": ("nvfp4-pack-quantized", dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16, scale_dtype="float8_e4m3fn"), None),
    "w4a16-g16": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16), None),
}


def tiny_model(dtype=torch.float32):
    import copy

    from nhil.models import get_model

    return copy.deepcopy(get_model("llama-tiny").model).to(dtype)


def _observe(module, args):
    """Scale / zero point / global scale of ``module.weight`` by compressed-tensors' qparam functions."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    w = module.weight.data
    gs = None
    if args.strategy == "tensor_group":
        gs = generate_gparam(w.min(), w.max())
        module.weight_global_scale.data.copy_(gs)
    if args.strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        mn, mx = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        n, k = w.shape
        pad = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
        b = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
        mn, mx = b.amin((1, 3)), b.amax((1, 3))
    else:
        mn, mx = w.amin(), w.amax()
    s, z = calculate_qparams(mn, mx, args, global_scale=gs)
    module.weight_scale.data.copy_(s.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(z.reshape(module.weight_zero_point.shape))


def write_ct_checkpoint(folder: Path, scheme: str, dtype=torch.float32, ignore=("lm_head",)) -> Path:
    """Write ``llama-tiny`` in compressed-tensors scheme ``scheme`` (:data:`SCHEMES`) to ``folder``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config

    fmt, wargs, aargs = SCHEMES[scheme]
    model = tiny_model(dtype)
    qs = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**wargs),
                            input_activations=QuantizationArgs(**aargs) if aargs else None, format=fmt)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qs}, ignore=list(ignore), format=fmt))
    with torch.no_grad():
        for name, m in model.named_modules():
            if getattr(m, "quantization_scheme", None) is not None:
                _observe(m, m.quantization_scheme.weights)
    comp = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    comp.compress_model(model)
    model.save_pretrained(folder)
    comp.update_config(str(folder))
    return folder


def write_fp8_block_checkpoint(folder: Path, block=(128, 128), scale_dtype=torch.float32) -> Path:
    """``llama-tiny`` in transformers' ``quant_method: fp8`` layout (DeepSeek-V3's quantizer: per block
    ``s = amax / 448``, ``q = e4m3(w / s)``; tensors ``weight`` float8_e4m3fn + ``weight_scale_inv``)."""
    from safetensors.torch import save_file

    model = tiny_model()
    model.save_pretrained(folder)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    bn, bk = block
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        w = sd[k]
        n, kk = w.shape
        pad = torch.nn.functional.pad(w, (0, -kk % bk, 0, -n % bn))
        b = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
        s = (b.abs().amax((1, 3)) / 448.0).to(scale_dtype)
        full = s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :kk]
        sd[k] = (w / full).to(torch.float8_e4m3fn)
        sd[k.removesuffix("weight") + "weight_scale_inv"] = s
    sd.pop("lm_head.weight", None)  # tied to the embedding
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def write_gpt_oss_mxfp4_checkpoint(folder: Path) -> Path:
    """The zoo's tiny ``gpt_oss`` with its experts in gpt-oss' published MXFP4 layout (openai/gpt-oss-20b):
    ``<proj>_blocks`` uint8 [E, out, in/32, 16] (E2M1 nibbles, element 2i in the low nibble), ``<proj>_scales``
    uint8 [E, out, in/32] (E8M0), ``<proj>_bias``; codes from nhil's OCP MX quantizer (FLOOR scale, RNE)."""
    import copy

    from safetensors.torch import save_file

    from nhil.models import get_model
    from nhil.numerics.formats import MXFP4

    model = copy.deepcopy(get_model("gpt_oss").model)
    model.save_pretrained(folder)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = sd.pop(k)  # [E, in, out] (transformers' gpt-oss layout)
        blocks, scales = [], []
        for e in range(w.shape[0]):
            qt = MXFP4.quantize(w[e].t().contiguous().numpy())  # [out, in]
            n, kk = qt.shape
            nib = qt.codes.reshape(n, kk // 32, 16, 2).astype("uint8")
            blocks.append(torch.from_numpy(nib[..., 0] | (nib[..., 1] << 4)))
            scales.append(torch.from_numpy(qt.rec[..., 0].copy()))
        sd[k + "_blocks"], sd[k + "_scales"] = torch.stack(blocks), torch.stack(scales)
    sd.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder
