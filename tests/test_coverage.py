"""The coverage table (nhil.coverage): quantized rtl/fpga runs appear in their cells, per recipe."""

from __future__ import annotations

from nhil.coverage import CoverageRow, render_markdown, target_cell


def test_quantized_runs_are_added_to_the_rtl_and_fpga_cells():
    moe = CoverageRow("mixtral", lower="ok", sim="PASS", rtl="PASS (bit-identical to sim)", fpga="PASS (bit-identical to sim)",
                      quant_runs={"rtl": {"q8_0": "PASS (bit-identical to sim)", "mxfp4": "MISMATCH (logits)"}}).as_dict()
    dense = CoverageRow("llama-tiny", lower="ok", sim="PASS", rtl="PASS (bit-identical to sim)", fpga="not run").as_dict()
    assert target_cell(moe, "rtl") == "bf16: PASS (bit-identical to sim); q8_0: PASS (bit-identical to sim); mxfp4: MISMATCH (logits)"
    assert target_cell(moe, "fpga") == "PASS (bit-identical to sim)"  # no quantized fpga run: the bf16 cell as before
    md = render_markdown([dense, moe], stamp="S", commit="c")
    assert md.startswith("Measured S at commit `c` by `nhil models --coverage --targets sim,rtl,fpga --quant q8_0,mxfp4` ")
    row = next(line for line in md.splitlines() if line.startswith("| mixtral "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-2:] == ["bf16: PASS (bit-identical to sim); q8_0: PASS (bit-identical to sim); mxfp4: MISMATCH (logits)", "PASS (bit-identical to sim)"]
    assert "--quant" not in render_markdown([dense], stamp="S", commit="c")


def test_a_cell_names_the_failed_checks_and_the_bit_identity(monkeypatch, tmp_path):
    import nhil.verify
    from nhil.coverage import _verify_cell

    seen = []

    def fake(o):
        seen.append((o.model, o.target, o.quant))
        same = {"name": "bit_identical_to_sim", "passed": o.quant != "int8"}
        if o.quant == "bf16":
            return {"outcome": "PASS", "checks": [same]}
        return {"outcome": "MISMATCH", "checks": [{"name": "logits_within_tolerance", "passed": True}, {"name": "expert_selection", "passed": False}, same]}

    monkeypatch.setattr(nhil.verify, "verify", fake)
    row = CoverageRow("mixtral")
    assert _verify_cell(row, "mixtral", "rtl", "bf16", 8, tmp_path) == "PASS (bit-identical to sim)"
    assert _verify_cell(row, "mixtral", "fpga", "mxfp4", 8, tmp_path) == "MISMATCH (expert_selection; bit-identical to sim)"
    assert _verify_cell(row, "mixtral", "rtl", "int8", 8, tmp_path) == "MISMATCH (expert_selection, bit_identical_to_sim)"
    assert seen == [("mixtral", "rtl", "bf16"), ("mixtral", "fpga", "mxfp4"), ("mixtral", "rtl", "int8")]
