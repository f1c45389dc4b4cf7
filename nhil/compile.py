"""Compile entry points shared by the CLI, verify and bench: model name -> Program, handoff bundle."""

from __future__ import annotations

import json
from pathlib import Path

from nhil.errors import SetupError
from nhil.isa import DEVICE_PRESETS, Program


def compile_model(model: str, device: str = "aim-like", max_cache_len: int = 64, quant: str = "bf16", passes=None) -> Program:
    """Export, raise, quantize and lower MODEL's decode step for a device preset (``nhil.compiler.pipeline``).

    Args:
        passes: scheduling pass names (default: the default pipeline, every pass).
    Raises:
        SetupError: unknown model, device preset or pass.
        CompileError: an op cannot be raised or lowered (names op, module path, source line).
    """
    from nhil.compiler import pipeline
    from nhil.models import get_model

    if device not in DEVICE_PRESETS:
        raise SetupError(f"unknown device preset {device!r}; presets: {', '.join(DEVICE_PRESETS)}")
    bundle = get_model(model)
    c = pipeline.compile(bundle, DEVICE_PRESETS[device], quant, pipeline.DEFAULT_PASSES if passes is None else passes,
                         max_cache_len=max_cache_len, model_name=model)
    return c.program


def write_bundle(folder: Path, model: str, program: Program, prompt: str | None, tokens: int) -> None:
    """Handoff bundle for backend engineers.

    Writes ``program.pimb``, ``program.pims`` (text form, without the image blob),
    ``golden.safetensors`` (prompt ids, tokens, logits and per-layer activations the
    program must reproduce: run it with ``nhil verify``), and ``MANIFEST.json`` (file
    sizes and sha256, device, ISA version, how to run it).
    """
    from nhil.golden.generate import generate_golden
    from nhil.golden.store import write_golden
    from nhil.isa.asm import disassemble
    from nhil.models import get_model
    from nhil.util import atomic_write_text, sha256_bytes

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    b = get_model(model)
    ids = b.encode(prompt)
    program.save(folder / "program.pimb")
    atomic_write_text(folder / "program.pims", disassemble(program))
    t, meta = generate_golden(b, ids, tokens, prompt_text=prompt)
    write_golden(folder / "golden.safetensors", t, meta)
    files = {}
    for name in ("program.pimb", "program.pims", "golden.safetensors"):
        data = (folder / name).read_bytes()
        files[name] = {"bytes": len(data), "sha256": sha256_bytes(data)}
    manifest = {
        "model": model,
        "device": program.device.name,
        "isa_version": 0,
        "max_cache_len": program.info.get("max_cache_len"),
        "passes": program.info.get("passes", []),
        "prompt_ids": ids,
        "golden_tokens": t["tokens"].tolist(),
        "files": files,
        "how_to_run": f"nhil verify --model {model} --target sim --tokens {tokens}",
        "docs": ["docs/isa.md", "docs/program-format.md", "docs/numerics.md"],
    }
    atomic_write_text(folder / "BUNDLE.json", json.dumps(manifest, indent=2))
