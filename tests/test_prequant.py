"""Pre-quantized checkpoints kept as shipped (issue 20 items 1-2): QUANT=native on compressed-tensors and
transformers ``quant_method: fp8`` folders written by compressed-tensors' own code (``tests/prequant_ckpt.py``).

Each checkpoint: its fp32 golden is the producer's dequantization (transformers + compressed-tensors); the
simulator equals the quantized reference bit for bit (tight tier); the bank rows read back from the target
hold the checkpoint's own code bytes and scale values, parsed from the safetensors file independently of
nhil's loader.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install -e '.[prequant]'; make venv installs it)")
sys.path.insert(0, str(Path(__file__).parent))
import prequant_ckpt  # noqa: E402

from nhil.errors import CompileError, SetupError  # noqa: E402

# checkpoint -> (nhil format of every quantized linear, the checkpoint's activation scheme or None)
CASES = {
    "w4a16": ("int4-g32-f32s", None),
    "w4a16-asym": ("int4-g64-asym-f32s", None),
    "w4a16-bf16": ("int4-g32-f32s", None),
    "w8a8": ("int8", "int8 token dynamic"),
    "fp8-block": ("fp8-e4m3-b32", None),
    "fp8-channel": ("fp8-e4m3", None),
    "nvfp4": ("nvfp4-gs", None),
    "fp8-deepseek": ("fp8-e4m3-b128", "fp8 e4m3 dynamic per-token group 128"),
}


def _write(root: Path, case: str) -> Path:
    d = root / case
    if case == "fp8-deepseek":
        return prequant_ckpt.write_fp8_block_checkpoint(d, (128, 128))
    if case == "w4a16-bf16":
        return prequant_ckpt.write_ct_checkpoint(d, "w4a16", dtype=torch.bfloat16)
    return prequant_ckpt.write_ct_checkpoint(d, case)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("prequant")
    return {c: _write(root, c) for c in [*CASES, "w4a16-g16"]}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _expected_rows(case: str, sd: dict, name: str, n: int, k: int):
    """Per output row: (element code bytes [K * bits / 8], per-block scale values fp32, per-block zero point or None,
    row header fp32 or None), straight from the checkpoint's tensors."""
    p = name.removesuffix("weight")
    if "weight_packed" in {t.removeprefix(p) for t in sd if t.startswith(p)}:
        raw = sd[p + "weight_packed"].contiguous().view(torch.uint8).numpy().reshape(n, -1)
    else:
        raw = sd[p + "weight"].contiguous().view(torch.uint8).numpy().reshape(n, k)
    scale = sd.get(p + "weight_scale", sd.get(p + "weight_scale_inv"))
    zp = None
    if p + "weight_zero_point" in sd:  # compressed-tensors' own unpacking (signed), stored by nhil as z + 8
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        zp = unpack_from_int32(sd[p + "weight_zero_point"], 4, torch.Size((n, scale.shape[1])), packed_dim=0).numpy().astype(np.int32) + 8
    header = None
    if case == "nvfp4":
        header = np.full(n, sd[p + "weight_global_scale"].item(), np.float32)
        s = scale.view(torch.uint8).numpy()  # UE4M3 byte
    elif case in ("w8a8", "fp8-channel"):
        header, s = scale.float().numpy().reshape(n), None
    elif case in ("fp8-block", "fp8-deepseek"):
        bn = 32 if case == "fp8-block" else 128
        s = scale.float().numpy()[np.arange(n) // bn]
    else:
        s = scale.float().numpy()
    return raw, s, zp, header


def _read_back_and_compare(case, bundle, prog, plan):
    """Every bank row of every quantized linear, read from the simulator after load, equals the checkpoint's bytes."""
    from nhil.compiler.quantize import hf_name
    from nhil.targets import get_target

    sd = _tensors(Path(bundle.source))
    dev = prog.device
    places = prog.info["quant"]["placements"]
    checked = 0
    with get_target("sim") as t:
        t.load(prog)
        for cname, qt in plan._cache.items():
            if qt is None:
                continue
            name = hf_name(cname)
            f = qt.fmt
            n, k = qt.shape
            raw, s, zp, header = _expected_rows(case, sd, name, n, k)
            p = places[cname]
            blk = f.block or k
            eb = blk * f.elem_bits // 8
            for gi, rg in enumerate(p["rows"]):
                for j, r in enumerate(rg):
                    e0, e1 = j * p["chunk"], min(k, (j + 1) * p["chunk"])
                    for slot in range(min(dev.slots, n - gi * dev.slots)):
                        o = gi * dev.slots + slot
                        row = np.ascontiguousarray(t.read_row(*divmod(slot, dev.banks), r), "<u2").view(np.uint8)
                        pos = f.header_bytes
                        if header is not None:
                            assert row[:4].view("<f4")[0] == header[o], (name, o)
                        for b in range(e0 // blk, -(-e1 // blk)):
                            rec = row[pos : pos + f.rec_bytes]
                            if case == "nvfp4":
                                assert rec[0] == s[o, b], (name, o, b)
                            elif s is not None:
                                assert rec[:4].view("<f4")[0] == s[o, b], (name, o, b)
                            if zp is not None:
                                assert rec[4] == zp[o, b], (name, o, b)
                            c0, c1 = b * blk, min(e1, (b + 1) * blk)
                            nb = (c1 - c0) * f.elem_bits // 8
                            assert np.array_equal(row[pos + f.rec_bytes : pos + f.rec_bytes + nb], raw[o, c0 * f.elem_bits // 8 : c1 * f.elem_bits // 8]), (name, o, b)
                            pos += f.rec_bytes + eb
                        checked += 1
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_native_checkpoint_verifies_bit_exact_and_holds_the_shipped_bytes(case, ckpts, tmp_path):
    """QUANT=native: PASS on sim (tight tier bit-identical to the quantized reference; accuracy vs the fp32 golden of
    the producer's dequantized weights), every quantized linear in the expected nhil format, bank rows = checkpoint bytes."""
    from nhil.compiler import pipeline
    from nhil.isa import DEVICE_PRESETS
    from nhil.models.from_path import load_model_path
    from nhil.verify import VerifyOptions, verify

    fmt, acts = CASES[case]
    bundle = load_model_path(str(ckpts[case]))
    assert {q.fmt.name for q in bundle.native.tensors.values()} == {fmt} and len(bundle.native.tensors) == 14
    assert bundle.native.activations == acts and not bundle.native.refused
    rep = verify(VerifyOptions(model=str(ckpts[case]), target="sim", tokens=4, quant="native", goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "PASS", rep.get("error")
    assert rep["tight"]["passed"] and rep["tight"]["elements_compared"] > 0
    _, raised = pipeline.export_and_raise(bundle, 16)
    plan = pipeline.quant_plan("native", raised, bundle)
    prog, _ = pipeline.lower(raised, DEVICE_PRESETS["aim-like"], plan=plan, model_name=case)
    assert prog.info["quant"]["matrices_per_format"] == {fmt: 14, "bf16": 1} or prog.info["quant"]["matrices_per_format"] == {fmt: 14}
    if case == "w8a8":  # int8 per-token dynamic: the W8A8 MAC mode (nhil.numerics.act_quant) runs it
        assert plan.act == "int8" and "activations" in plan.describe() and "activations_not_applied" not in plan.describe()
        assert all(p.get("format") == "int8" for p in prog.info["quant"]["placements"].values() if p.get("format") != "bf16")
    elif acts:  # fp8 per-token-group 128 (DeepSeek): weights exact, activations bf16, said so
        assert plan.act is None and "activations_not_applied" in plan.describe()
    assert _read_back_and_compare(case, bundle, prog, plan) > 0


def test_golden_weights_are_the_producers_dequantization(ckpts):
    """The fp32 model is compressed-tensors' decompression (transformers' loader), not nhil's: equal to calling
    compressed-tensors' ``dequantize`` on the checkpoint's tensors directly, and nhil's reading matches it (NVFP4:
    after compressed-tensors' bf16 rounding of the result)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from nhil.models.from_path import load_model_path

    b = load_model_path(str(ckpts["nvfp4"]))
    sd = _tensors(ckpts["nvfp4"])
    p = "model.layers.1.mlp.down_proj."
    args = QuantizationArgs(**prequant_ckpt.SCHEMES["nvfp4"][1])
    x = unpack_fp4_from_uint8(sd[p + "weight_packed"], *b.model.get_parameter(p + "weight").shape)
    want = dequantize(x, sd[p + "weight_scale"].to(torch.bfloat16), args=args, global_scale=sd[p + "weight_global_scale"], dtype=torch.bfloat16)
    assert torch.equal(b.model.get_parameter(p + "weight").detach(), want.float())
    mine = torch.from_numpy(b.native.tensors[p + "weight"].dequantize())
    assert torch.equal(mine.to(torch.bfloat16), want) and not torch.equal(mine, want.float())  # nhil keeps fp32(e * s_b / g)
    # compressed-tensors' own arithmetic in fp32 (scale = s_b / g, then e * scale) is nhil's nvfp4-gs dequantization, bit for bit
    want32 = dequantize(x.float(), sd[p + "weight_scale"].float(), args=args, global_scale=sd[p + "weight_global_scale"], dtype=torch.float32)
    assert torch.equal(mine, want32)


def test_unrepresentable_scheme_is_a_compile_fail_naming_scheme_and_tensor(ckpts, tmp_path):
    """int4 groups of 16 (no nhil format): the model loads (golden from compressed-tensors), QUANT=native is COMPILE_FAIL."""
    from nhil.models.from_path import load_model_path
    from nhil.verify import VerifyOptions, verify

    b = load_model_path(str(ckpts["w4a16-g16"]))
    assert len(b.native.refused) == 14 and not b.native.tensors
    rep = verify(VerifyOptions(model=str(ckpts["w4a16-g16"]), target="sim", tokens=2, quant="native", goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "COMPILE_FAIL"
    assert "pack-quantized int4 group group 16" in rep["error"] and "model.layers.0." in rep["error"] and "never re-quantizes" in rep["error"]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_name_the_tensor(ckpts, tmp_path):
    from safetensors.torch import save_file

    from nhil.models.from_path import load_model_path

    # a scale of the wrong shape
    d = _copy(ckpts["w4a16"], tmp_path / "badscale")
    sd = _tensors(d)
    sd["model.layers.1.self_attn.v_proj.weight_scale"] = sd["model.layers.1.self_attn.v_proj.weight_scale"][:, :1].contiguous()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SetupError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight_scale: group scale has shape \[32, 1\], the scheme needs \[32, 2\]"):
        load_model_path(str(d))
    # a group size that does not divide K
    d = _copy(ckpts["w4a16"], tmp_path / "badgroup")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SetupError, match=r"model\.layers\.0\.\S+\.weight: group size 48 does not divide K = 64"):
        load_model_path(str(d))
    # an unknown scheme
    d = _copy(ckpts["w4a16"], tmp_path / "badmethod")
    cfg["quantization_config"]["quant_method"] = "hqq"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SetupError, match="quant_method 'hqq' is not one nhil reads"):
        load_model_path(str(d))
    # an FP8 block scale grid that does not fit the weight
    d = _copy(ckpts["fp8-deepseek"], tmp_path / "badfp8")
    sd = _tensors(d)
    sd["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 2)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SetupError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv: block scale for blocks 128x128 has shape \[2, 2\], the scheme needs \[1, 1\]"):
        load_model_path(str(d))


def test_native_on_a_plain_folder_is_a_compile_error(tmp_path):
    from nhil.compiler.quantize import build_plan

    with pytest.raises(CompileError, match="neither from a GGUF file nor from a pre-quantized folder"):
        build_plan("native")


def test_rtl_does_not_claim_the_prequant_formats():
    """The RTL's MAC lanes decode FORMATS only: a program in a pre-quantized format is refused at load, naming it
    (verify reports such an rtl/fpga run SKIPPED, not claimed)."""
    from nhil.numerics.formats import FORMATS, PREQUANT
    from nhil.targets.rtl.target import RTL_FORMATS

    assert RTL_FORMATS == frozenset({"bf16", *FORMATS}) and not (RTL_FORMATS & set(PREQUANT))
    assert set(PREQUANT) == {"int4-g32-f32s", "int4-g64-f32s", "int4-g128-f32s", "int4-g32-asym-f32s", "int4-g64-asym-f32s",
                             "int4-g128-asym-f32s", "fp8-e4m3-b16", "fp8-e4m3-b32", "fp8-e4m3-b64", "fp8-e4m3-b128", "nvfp4-gs"}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rtl", "fpga"])
def test_rtl_and_fpga_runs_of_a_prequant_checkpoint_are_skipped_naming_the_format(target, ckpts, tmp_path):
    from nhil.verify import VerifyOptions, verify

    rep = verify(VerifyOptions(model=str(ckpts["nvfp4"]), target=target, tokens=2, quant="native", goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "SKIPPED" and "nvfp4-gs" in rep["error"], (rep["outcome"], rep.get("error"))


def test_read_back_sees_a_corrupted_bank_row(ckpts):
    """The read-back comparison can fail: one flipped code byte in one bank row after load is found."""
    from nhil.compiler import pipeline
    from nhil.isa import DEVICE_PRESETS
    from nhil.models.from_path import load_model_path
    from nhil.targets.sim.target import SimTarget

    bundle = load_model_path(str(ckpts["fp8-deepseek"]))
    _, raised = pipeline.export_and_raise(bundle, 16)
    plan = pipeline.quant_plan("native", raised, bundle)
    prog, _ = pipeline.lower(raised, DEVICE_PRESETS["aim-like"], plan=plan, model_name="x")
    row = next(iter(prog.info["quant"]["placements"].values()))["rows"][0][0]
    load = SimTarget.load

    def corrupt(self, program):
        load(self, program)
        w = self.read_row(0, 1, row)
        w[3] ^= 0x0100  # a code byte of output row 1 (bytes 4..7 hold codes after the 4-byte block scale)
        self.write_row(0, 1, row, w)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SimTarget, "load", corrupt)
        with pytest.raises(AssertionError):
            _read_back_and_compare("fp8-deepseek", bundle, prog, plan)
    assert _read_back_and_compare("fp8-deepseek", bundle, prog, plan) > 0


@pytest.mark.slow
def test_gpt_oss_mxfp4_experts_native(tmp_path):
    """gpt-oss' MXFP4 expert layout (``quant_method: mxfp4``, written by hand from the published layout): transformers'
    dequantization (``Mxfp4Config(dequantize=True)``) equals nhil's reading bit for bit (checked at load); QUANT=native
    verifies on sim with the tight tier bit-exact; every expert bank row holds the file's E8M0 byte and nibble bytes."""
    from nhil.compiler import pipeline
    from nhil.compiler.quantize import hf_name
    from nhil.isa import DEVICE_PRESETS
    from nhil.models.from_path import load_model_path
    from nhil.targets import get_target
    from nhil.verify import VerifyOptions, verify

    d = prequant_ckpt.write_gpt_oss_mxfp4_checkpoint(tmp_path / "gpt-oss-mxfp4")
    bundle = load_model_path(str(d))
    assert len(bundle.native.tensors) == 24 and {q.fmt.name for q in bundle.native.tensors.values()} == {"mxfp4"}
    rep = verify(VerifyOptions(model=str(d), target="sim", tokens=3, quant="native", goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "PASS" and rep["tight"]["passed"], rep.get("error")
    assert rep["quant"]["matrices_per_format"] == {"bf16": 11, "mxfp4": 24}
    sd = _tensors(d)
    _, raised = pipeline.export_and_raise(bundle, 16)
    plan = pipeline.quant_plan("native", raised, bundle)
    prog, _ = pipeline.lower(raised, DEVICE_PRESETS["aim-like"], plan=plan, model_name="g")
    dev = prog.device
    n_rows = 0
    with get_target("sim") as t:
        t.load(prog)
        for cname, p in prog.info["quant"]["placements"].items():
            if p["format"] != "mxfp4":
                continue
            stem, e, *part = hf_name(cname).rsplit(".", 2) if hf_name(cname).endswith((".gate", ".up")) else (*hf_name(cname).rsplit(".", 1), None)
            rows = slice(0, None, 2) if part == ["gate"] else slice(1, None, 2) if part == ["up"] else slice(None)
            blocks = sd[stem + "_blocks"][int(e)].numpy()[rows]  # [out, in/32, 16]
            scales = sd[stem + "_scales"][int(e)].numpy()[rows]
            for slot in range(blocks.shape[0]):
                row = np.ascontiguousarray(t.read_row(slot // dev.banks, slot % dev.banks, p["rows"][0][0]), "<u2").view(np.uint8)
                recs = row[: blocks.shape[1] * 17].reshape(-1, 17)
                assert np.array_equal(recs[:, 0], scales[slot]) and np.array_equal(recs[:, 1:], blocks[slot]), (cname, slot)
                n_rows += 1
    assert n_rows == 2 * 4 * (64 + 64 + 64)
