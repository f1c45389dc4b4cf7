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


BUNDLE_DOCS = ("isa.md", "program-format.md", "numerics.md", "golden-format.md", "outcomes.md")


def _copy_docs(folder: Path) -> list[str]:
    """Copy the format docs a backend engineer needs into ``<folder>/docs/``; returns the copied paths.

    Raises:
        SetupError: a doc is missing (an installed nhil without its docs folder).
    """
    from nhil.util import atomic_write_bytes

    src = Path(__file__).resolve().parent.parent / "docs"
    out = []
    for name in BUNDLE_DOCS:
        if not (src / name).is_file():
            raise SetupError(f"the handoff bundle needs {src / name}, which this nhil installation lacks; run from a source checkout")
        atomic_write_bytes(folder / "docs" / name, (src / name).read_bytes())
        out.append(f"docs/{name}")
    return out


def write_bundle(folder: Path, model: str, program: Program, prompt: str | None, tokens: int) -> None:
    """Handoff bundle for backend engineers.

    Writes ``program.pimb``, ``program.pims`` (text form, without the image blob),
    ``golden.safetensors`` (prompt ids, tokens, logits and per-layer activations the
    program must reproduce) with its ``MANIFEST.json``, the format docs under ``docs/``, and
    ``BUNDLE.json`` (file sizes and sha256, device, ISA version, how to run it: ``nhil run
    <folder> --target T``). No lock file is left inside.
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
    (folder / "MANIFEST.json.lock").unlink(missing_ok=True)  # the golden store's lock: not part of the bundle
    docs = _copy_docs(folder)
    files = {}
    for name in ("program.pimb", "program.pims", "golden.safetensors", "MANIFEST.json", *docs):
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
        "how_to_run": f"nhil run {folder} --target sim",
        "how_to_run_other_targets": f"nhil run {folder} --target rtl   |   nhil run {folder} --target fpga",
        "how_to_recompile": f"nhil verify --model {model} --target sim --tokens {tokens}",
        "docs": docs,
    }
    atomic_write_text(folder / "BUNDLE.json", json.dumps(manifest, indent=2))
