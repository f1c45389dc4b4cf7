"""Each decoder layer's output is read off the exported graph (``nhil.compiler.layer_outputs``), not
guessed from module names or the last op's kind: the values it names are the transformers decoder
layers' own outputs, bit for bit (Gemma 4's layers end with a scalar multiply after the residual add)."""

from __future__ import annotations

import pytest
import torch


def _values_of(ep, nodes, input_ids, cache_position):
    """Values of ``nodes`` when the exported graph runs one step (an fx Interpreter over the lifted graph)."""
    sig = ep.graph_signature
    state = {**ep.state_dict, **ep.constants}
    args = [state[n].clone() for n in (*sig.parameters, *sig.buffers, *getattr(sig, "lifted_tensor_constants", ()))]
    seen: dict = {}

    class Capture(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n in nodes:
                seen[n] = out.clone()
            return out

    with torch.no_grad():
        Capture(ep.graph_module).run(*args, input_ids, cache_position)
    return seen


@pytest.mark.parametrize("arch", ["gemma4_text", "llama"])
def test_layer_outputs_are_the_decoder_layers_outputs(arch, tmp_path):
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from nhil.compiler.export import export_decode
    from nhil.compiler.layer_outputs import decoder_layer_outputs
    from nhil.golden.decoder_stack import find_decoder_stack
    from nhil.landscape.tiny_config import tiny_config
    from nhil.models.from_path import _load_config_only

    tiny_config(arch).save_pretrained(tmp_path)
    model = _load_config_only(tmp_path / "config.json", None, 0).model
    ep, _ = export_decode(model, 16)
    outs = decoder_layer_outputs(ep.graph)
    stack = find_decoder_stack(model)
    assert sorted(outs) == list(range(len(stack.layers)))
    got = _values_of(ep, set(outs.values()), torch.tensor([[7]]), torch.tensor([0]))

    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=16,
                                               cache_config={"batch_size": 1, "max_cache_len": 16})
    static = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16).model
    want: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: want.__setitem__(k, (o[0] if isinstance(o, tuple) else o).clone()))
             for k, layer in enumerate(stack.layers)]
    try:
        with torch.no_grad():
            static(input_ids=torch.tensor([[7]]), cache_position=torch.tensor([0]))
    finally:
        for h in hooks:
            h.remove()
    for i, n in outs.items():
        assert torch.equal(got[n].reshape(want[i].shape), want[i]), (arch, i, n.name)
