"""The decode-step breakdown (nhil.timing.breakdown) on SmolLM2-135M's shape, 16-position cache, aim-like."""

import pytest

# SmolLM2-135M by hand (config: hidden 576, 9 heads x 64 / 3 KV heads, intermediate 1536, 30 layers, vocab 49152):
# per layer q, o 576x576; k, v 576x192; gate, up, down 576x1536 each; plus the lm_head 49152x576.
WEIGHT_ELEMS = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576
# aim-like: 32 channels x 16 banks, a burst = 16 bf16 lanes = 32 B, one MAC burst per nCCD = 2 cycles
USEFUL_MAC_CYCLES = 2 * WEIGHT_ELEMS * 2 / (32 * 16 * 32)
LAT = 1000  # 500 ns hand-off at tCK 0.5 ns


@pytest.fixture(scope="module")
def study():
    from nhil.timing.host_share import host_share_study

    return host_share_study(max_cache_len=16, breakdown=True)


def test_breakdown_adds_up_and_its_parts_match_hand_counts(study):
    for which in ("before", "after"):
        b = study["breakdown"][which]
        rows = {r["cause"]: r["cycles"] for r in b["rows"]}
        assert sum(rows.values()) == pytest.approx(b["cycles"], abs=1e-6)  # additive: exposed cycles by cause
        assert rows["weight MACs: useful bursts at nCCD"] == USEFUL_MAC_CYCLES == 32832
        assert rows["weight MACs: padding bursts at nCCD"] > 0  # 576-wide rows in 1024-element rows
    before, after = study["breakdown"]["before"], study["breakdown"]["after"]
    assert dict((r["cause"], r["cycles"]) for r in before["rows"])["SYNC hand-off"] == 181 * LAT
    assert before["cycles"] == study["rows"][0]["cycles_per_token"] and after["cycles"] == study["rows"][3]["cycles_per_token"]


def test_what_if_caps_order_and_the_device_only_cap(study):
    """Each cap removes a cost, so it never costs cycles; removing more never costs more. The device-only step (no hand-off,
    no host time) stays under 0.5 of the bound: the goal needs the row timing too (docs/timing-model.md "Step breakdown")."""
    for b in study["breakdown"].values():
        w = {r["case"]: r for r in b["what_if"]}
        dev = w["no hand-off, no host time (device only)"]
        rows = w["device only + free row timing"]
        assert dev["cycles"] < min(w["no hand-off latency"]["cycles"], w["no host kernel time"]["cycles"]) < b["cycles"]
        assert w["device only + free rows + no refresh"]["cycles"] <= rows["cycles"] < dev["cycles"]
        assert dev["of_bound"] < 0.5 < rows["of_bound"]
        for r in w.values():
            assert r["of_bound"] == pytest.approx(r["tokens_per_s"] / b["bound_tokens_per_s"])


def test_bench_rows_carry_the_breakdown(study):
    from nhil.timing.host_share import host_share_table_rows

    labels = [r[0] for r in host_share_table_rows(study)]
    assert "step breakdown (L=16, after)" in labels and "  SYNC hand-off" in labels
    assert "  cap if no hand-off, no host time (device only)" in labels
