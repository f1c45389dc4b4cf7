"""Host ATen regions (nhil.compiler.host_aten, nhil.runtime.aten_graph): what no pattern raises
runs on the host as the exported ops, bit-exact; PIM-bound work never hides there.

References: PyTorch eager (the ops run directly), the transformers module (verify's golden),
the device-numerics reference (verify's tight tier, bit for bit).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from nhil.runtime import aten_graph as ag


class SoftsignNorm(torch.nn.Module):
    """A norm no nhil pattern knows: ``w * x / (1 + mean|x|)``."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(w.clone())

    def forward(self, x):
        return self.weight * x / (1.0 + x.abs().mean(-1, keepdim=True))


class ReluSquared(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) ** 2


class InlineDown(torch.nn.Module):
    """An MLP whose down projection is written ``matmul(h, W.t())``: a GEMV no pattern raises."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        m = self.mlp
        return torch.matmul(m.act_fn(m.gate_proj(x)) * m.up_proj(x), m.down_proj.weight.t())


def _registered(monkeypatch, name: str, edit):
    from nhil.models import get_model, registry

    b = copy.copy(get_model("llama-tiny"))
    b.model = copy.deepcopy(b.model)
    edit(b.model)
    b.name = name
    monkeypatch.setitem(registry._CACHE, name, b)
    monkeypatch.setitem(registry._REGISTRY, name, (lambda: b, "test"))
    return b


def _verify(model: str, tmp_path: Path) -> dict:
    from nhil.verify import VerifyOptions, verify

    return verify(VerifyOptions(model=model, target="sim", tokens=6, goldens_dir=tmp_path / "goldens", runs_dir=tmp_path / "runs"))


def test_a_model_whose_novelty_is_host_side_passes_with_no_nhil_change(monkeypatch, tmp_path):
    def edit(m):
        for layer in m.model.layers:
            layer.input_layernorm = SoftsignNorm(layer.input_layernorm.weight.data)
            layer.mlp.act_fn = ReluSquared()

    _registered(monkeypatch, "llama-softsign", edit)
    rep = _verify("llama-softsign", tmp_path)
    assert rep["outcome"] == "PASS", rep.get("error") or rep.get("divergence_summary")
    tight = next(c for c in rep["checks"] if c["name"] == "tight_bit_identical_to_reference")
    assert tight["passed"]
    pl = rep["placement"]
    assert pl["host_aten"]["aten.relu.default"] == 2 and pl["host_aten"]["aten.abs.default"] == 2
    assert pl["pim"]["nhil::linear"] == 15 and pl["pim"]["nhil::attention_kv"] == 2
    assert pl["weights"]["share"] == 1.0 and pl["macs"]["pim_share"] == 1.0
    assert "host ATen" in (Path(rep["run_dir"]) / "report.md").read_text()


def test_a_projection_in_an_unknown_form_fails_naming_it(monkeypatch, tmp_path):
    def edit(m):
        m.model.layers[1].mlp = InlineDown(m.model.layers[1].mlp)

    _registered(monkeypatch, "llama-inline-down", edit)
    rep = _verify("llama-inline-down", tmp_path)
    assert rep["outcome"] == "COMPILE_FAIL"
    assert "layers.1.mlp" in rep["error"] and "down_proj.weight" in rep["error"] and "PIM-bound" in rep["error"]


# ------------------------------------------------------------------ the spec and its executor


def _spec_of(fn, *inputs):
    """Export ``fn`` and encode its ATen graph as a host ATen spec (as lower_host_aten does)."""
    gm = torch.export.export(_Wrap(fn), tuple(inputs)).module()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ref = {p: i for i, p in enumerate(phs)} | {n: len(phs) + i for i, n in enumerate(nodes)}
    ops = [[ag.op_name(n.target), ag.encode(list(n.args), ref.__getitem__), {k: ag.encode(v, ref.__getitem__) for k, v in n.kwargs.items()}] for n in nodes]
    out = gm.graph.output_node().args[0][0]
    in_specs = [[list(x.shape), ag.dtype_name(x.dtype)] for x in inputs]
    res = fn(*inputs)
    return ops, in_specs, [[ref[out], list(res.shape), ag.dtype_name(res.dtype)]], res


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def test_spec_runs_bit_identically_to_eager():
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(64, generator=torch.Generator().manual_seed(2))

    def f(x, w):  # a norm nhil has no primitive for, with a float('-inf') clamp bound
        return (w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).clamp(min=float("-inf"), max=3.0)

    ops, ins, outs, want = _spec_of(f, x, w)
    assert any(isinstance(a, dict) and "$f" in a for op in ops for a in op[1])  # -inf carried as {"$f": "-inf"}
    assert ag.check_spec(ops, ins, outs) is None
    got = np.zeros(64, np.float32)
    ag.run(ops, ins, outs, [x.numpy().reshape(-1), w.numpy()], [got])
    assert np.array_equal(got.view(np.uint32), want.reshape(-1).numpy().view(np.uint32))


def test_integer_values_round_trip_and_big_ones_are_refused():
    ops = [["aten.mul.Tensor", [{"$v": 0}, 3], {}]]
    ins, outs = [[[4], "int64"]], [[1, [4], "int64"]]
    got = np.zeros(4, np.float32)
    ag.run(ops, ins, outs, [np.array([1, 2, 3, 4], np.float32)], [got])
    assert got.tolist() == [3, 6, 9, 12]
    with pytest.raises(RuntimeError, match="2\\^24"):
        ag.run(ops, ins, outs, [np.array([1, 2, 3, 2**23], np.float32)], [got])


@pytest.mark.parametrize("ops, why", [
    ([["aten.index_copy_.default", [{"$v": 0}, 0, {"$v": 0}, {"$v": 0}], {}]], "mutates"),
    ([["aten.rand.default", [[4]], {}]], "nondeterministic"),
    ([["builtins.eval", ["print(1)"], {}]], "is not 'aten."),
    ([["aten.no_such_op.default", [], {}]], "does not exist"),
    ([["aten.neg.default", [{"$v": 5}], {}]], "references value 5"),
    ([["aten.dropout.default", [{"$v": 0}, 0.1, True], {}]], "train=False"),
    ([["aten.neg.default", "x", {}]], "must be [op, args, kwargs]"),
])
def test_malformed_or_unsafe_specs_are_refused(ops, why):
    assert why in (ag.check_spec(ops, [[[4], "float32"]], [[1, [4], "float32"]]) or "")


def test_a_program_with_a_tampered_host_aten_op_is_refused_at_load(monkeypatch):
    from nhil.compiler.pipeline import compile as pcompile
    from nhil.errors import ProgramFormatError
    from nhil.isa.program import Program

    def edit(m):
        m.model.layers[0].mlp.act_fn = ReluSquared()

    b = _registered(monkeypatch, "llama-relu2", edit)
    prog = pcompile(b, "aim-like", max_cache_len=16).program
    (i, h), = [(i, h) for i, h in enumerate(prog.host_ops) if h.kernel == "aten_graph" and any("relu" in o[0] for o in h.attrs["ops"])]
    assert Program.decode(prog.encode()).host_ops[i].attrs == h.attrs
    h.attrs["ops"][0][0] = "aten.index_copy_.default"
    with pytest.raises(ProgramFormatError, match=f"host op {i}: .*mutates"):
        Program.decode(prog.encode())


def test_eager_attention_runs_its_products_on_pim_and_its_score_transform_as_host_aten(monkeypatch, tmp_path):
    """Llama with ``attn_implementation="eager"``: no SDPA, so the attention anchors find
    ``matmul(q, Kᵀ)`` and ``matmul(p, V)`` over the cache writes (nhil::attention_scores /
    attention_values on PIM); scale, additive mask and softmax run as the exported ops."""

    def edit(m):
        m.config._attn_implementation = "eager"

    _registered(monkeypatch, "llama-eager", edit)
    rep = _verify("llama-eager", tmp_path)
    assert rep["outcome"] == "PASS", rep.get("error") or rep.get("divergence_summary")
    assert next(c for c in rep["checks"] if c["name"] == "tight_bit_identical_to_reference")["passed"]
    pl = rep["placement"]
    assert pl["pim"]["nhil::attention_scores"] == 2 and pl["pim"]["nhil::attention_values"] == 2 and "nhil::attention_kv" not in pl["pim"]
    assert pl["host_aten"]["aten.softmax.int"] == 2 and pl["macs"]["pim_share"] == 1.0
