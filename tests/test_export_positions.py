"""Decode export of models whose positions come from a tensor's value, and goldens of models whose
``generate()`` computes another function than their forward (``nhil.compiler.export``, ``nhil.golden.generate``)."""

from __future__ import annotations

import pytest
import torch

from nhil.errors import CompileError


def _tiny(arch: str, tmp_path):
    from nhil.landscape.tiny_config import tiny_config
    from nhil.models.from_path import _load_config_only

    tiny_config(arch).save_pretrained(tmp_path)
    return _load_config_only(tmp_path / "config.json", None, 0)


def _static(model, L=16):
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=L,
                                               cache_config={"batch_size": 1, "max_cache_len": L})
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=L).model


@pytest.mark.parametrize("arch", ["opt", "bert"])
def test_exported_decode_step_equals_eager_with_positions_handed_in(arch, tmp_path):
    """OPT slices a cumsum at ``cache.get_seq_length()``, BERT its position buffer: the export hands the cache
    position in as ``position_ids``; the exported step's logits equal the eager static-cache step's bit for bit at
    every position, and no slice of the graph is bounded by a tensor's value."""
    from nhil.compiler.export import _value_sliced, export_decode

    b = _tiny(arch, tmp_path)
    ep, _ = export_decode(b.model, 16)
    assert not _value_sliced(ep)
    static = _static(b.model)
    run = ep.module()
    with torch.no_grad():
        for p, tok in enumerate([5, 17, 3, 200]):
            want = static(input_ids=torch.tensor([[tok]]), cache_position=torch.tensor([p]))
            got = run(input_ids=torch.tensor([[tok]]), cache_position=torch.tensor([p]))
            assert torch.equal(got, want), (arch, p)


def test_positions_that_are_not_cache_positions_are_refused(tmp_path):
    """RoBERTa counts positions from padding_idx + 1: handing in the cache position would change its logits, so
    the check refuses it (OPT's learned positions take it unchanged)."""
    from nhil.compiler.export import _same_steps_with_positions

    why = RuntimeError("data-dependent")
    _same_steps_with_positions(_static(_tiny("opt", tmp_path / "opt").model), _tiny("opt", tmp_path / "opt2").model, None, why)
    rob = _tiny("roberta", tmp_path / "rob").model
    with pytest.raises(CompileError, match="positions are not its cache positions"):
        _same_steps_with_positions(_static(rob), rob, None, why)


def test_golden_greedy_follows_the_forward_when_generate_computes_another_function(tmp_path):
    """RoBERTa's generate() hands in positions from the attention mask, its forward counts from padding_idx + 1:
    the golden tokens are then the forward's own greedy argmax (checked here against fresh forwards)."""
    from nhil.golden.generate import generate_golden

    b = _tiny("roberta", tmp_path)
    prompt = [47, 211, 38, 53, 204, 116]
    tensors, meta = generate_golden(b, prompt, 6, seed=0)
    assert meta["greedy"].startswith("forward without cache")
    seq = list(prompt)
    with torch.no_grad():
        for t in tensors["tokens"].tolist():
            ids = torch.tensor([seq])
            assert t == int(b.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, -1].argmax())
            seq.append(t)
    assert torch.equal(tensors["logits"].argmax(-1), tensors["tokens"])
