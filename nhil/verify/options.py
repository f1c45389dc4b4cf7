"""Options of one ``nhil verify`` run (:class:`VerifyOptions`) and the default tolerance profile."""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path

PROFILE = "bf16-act-fp32-acc"
SAVE_PROGRAM_MAX_BYTES = int(os.environ.get("NHIL_SAVE_PROGRAM_MAX_BYTES", 64 << 20))  # bigger programs: `nhil compile -o`


@dataclasses.dataclass
class VerifyOptions:
    """Options of one verify run (the Makefile variables in brackets).

    Attributes:
        model: registry name [MODEL].
        target: target name [TARGET].
        prompt: prompt text (or comma-separated ids for tokenizer-less models) [PROMPT].
        tokens: tokens to decode [TOKENS].
        seed: run seed [SEED].
        device: DeviceConfig preset to compile for; default: the target's own device [DEVICE].
        regen: regenerate the golden even if a matching one exists [REGEN].
        goldens_dir / runs_dir: where goldens and run folders live.
        target_options: extra keyword options for the target factory.
        lockstep: for non-sim targets, also run the simulator and compare at every SYNC.
        save_program: write ``program.pimb`` into the run folder (programs up to 64 MiB).
        repeat: run the teacher-forced pass this many times and check the logits are
            bit-identical across repeats (determinism, separate from accuracy) [REPEAT].
        stage_timeout_scale: multiplies every stage's timeout (``STAGE_TIMEOUTS``).
        manifest: expectations manifest (default ``nhil.expectations.DEFAULT_PATH``): the
            expected outcome and the row's tolerance overrides come from it.
        prefill: run the prompt through a prefill program (``nhil.compiler.prefill``) when the program
            and target allow it, else token by token; ``NHIL_PREFILL=token`` sets it False.
    """

    model: str = "llama"
    target: str = "sim"
    prompt: str | None = None
    tokens: int = 16
    seed: int = 0
    device: str | None = None
    regen: bool = False
    goldens_dir: Path = Path("goldens")
    runs_dir: Path = Path("runs")
    target_options: dict = dataclasses.field(default_factory=dict)
    lockstep: bool = True
    save_program: bool = True
    repeat: int = 1
    quant: str = "bf16"  # weight quantization recipe [QUANT] (nhil.compiler.quantize), e.g. native, mxfp4, int4-g128:lm_head=bf16
    stage_timeout_scale: float = float(os.environ.get("NHIL_STAGE_TIMEOUT_SCALE", "1"))
    manifest: Path | None = None
    layers: int | None = None  # --model PATH only: keep the first N decoder layers [LAYERS]
    passes: tuple = ()  # scheduling passes (nhil.compiler.pipeline); () here = the default pipeline, set in __post_init__
    prefill: bool = os.environ.get("NHIL_PREFILL", "program") != "token"
    kv_cache: str = "bf16"  # --kv-cache: bf16 | fp8 (E4M3, per-head scales; nhil.numerics.kv_fp8): folded into quant as kv_cache=fp8

    def __post_init__(self) -> None:
        if self.kv_cache != "bf16":
            from nhil.compiler.quantize import with_kv_cache
            from nhil.args import UsageError
            from nhil.errors import CompileError

            try:
                self.quant, self.kv_cache = with_kv_cache(self.quant, self.kv_cache), "bf16"
            except CompileError as e:
                raise UsageError(str(e)) from None
        if not self.passes:
            from nhil.compiler.pipeline import DEFAULT_PASSES

            self.passes = DEFAULT_PASSES
        self.passes = tuple(self.passes)
        check_passes(self.passes)

    def reproducer(self) -> str:
        parts = [f"make verify MODEL={self.model} TARGET={self.target} TOKENS={self.tokens} SEED={self.seed}"]
        if self.prompt is not None:
            parts.append(f"PROMPT={shlex.quote(self.prompt)}")
        if self.device:
            parts.append(f"DEVICE={self.device}")
        if self.quant != "bf16":
            parts.append(f"QUANT={shlex.quote(self.quant)}")
        if self.layers is not None:
            parts.append(f"LAYERS={self.layers}")
        from nhil.compiler.pipeline import DEFAULT_PASSES

        if tuple(self.passes) != DEFAULT_PASSES:
            parts.append(f"PASSES={','.join(self.passes)}")
        for env in ("FPGA_PORT", "FPGA_BAUD", "FPGA_FAULTS", "FPGA_BOARD", "WAVES", "NHIL_SIM_THREADS"):
            if os.environ.get(env):
                parts.append(f"{env}={shlex.quote(os.environ[env])}")
        return " ".join(parts)


def parse_passes(text: str | None) -> tuple[str, ...]:
    """``nhil verify --passes`` text -> pass names: comma-separated; ``default`` stands for the default pipeline
    (``nhil.compiler.pipeline.DEFAULT_PASSES``), so ``default,ew-swiglu`` adds an opt-in pass. ``None`` -> ``()``
    (the default pipeline).

    Raises:
        UsageError: an empty list, or an unknown pass name (:func:`check_passes`).
    """
    if text is None:
        return ()
    from nhil.args import UsageError
    from nhil.compiler.pipeline import DEFAULT_PASSES

    names: list[str] = []
    for n in (p.strip() for p in text.split(",")):
        if n == "default":
            names.extend(DEFAULT_PASSES)
        elif n:
            names.append(n)
    if not names:
        raise UsageError(f"--passes {text!r} names no pass; give 'default' (the default pipeline) and/or pass names: {_valid_passes()}")
    out = tuple(dict.fromkeys(names))
    check_passes(out)
    return out


def _valid_passes() -> str:
    from nhil.compiler.schedule import OPT_IN, PIPELINE

    return f"default: {', '.join(PIPELINE)}; opt-in: {', '.join(OPT_IN)}"


def check_passes(passes) -> None:
    """Raise ``UsageError`` naming every unknown scheduling pass in ``passes`` and listing the valid ones (``nhil.compiler.schedule.ORDER``)."""
    from nhil.args import UsageError
    from nhil.compiler.schedule import PASS_INFO

    bad = [n for n in passes if n not in PASS_INFO]
    if bad:
        raise UsageError(f"unknown scheduling pass(es) {', '.join(map(repr, bad))}; valid passes are {_valid_passes()}")
