"""The compile pipeline: export -> raise -> quantize -> lower -> program passes, once, for every caller.

``verify``, ``nhil compile`` (and the handoff bundle), the bench, the coverage table, the
quantization report and the shape-only compile of large configs all go through this
module, so the sequence is written once and a program always records what shaped it.

Stages (each one optionally wrapped in a caller's ``stage(name)`` context, which is how
``verify`` times them and arms their timeouts):

1. ``export``: ``torch.export`` of the decode step with a static KV cache
   (:func:`nhil.compiler.export.export_decode`);
2. ``raise``: ATen -> ``nhil::*`` primitives, checked bit-exact against the exported
   graph (:func:`nhil.compiler.raising.raise_graph`);
3. ``quantize`` (only for a recipe other than ``bf16``): the weight-format plan
   (:func:`nhil.compiler.quantize.build_plan`);
4. ``lower``: graph IR -> PIM program (:func:`nhil.compiler.lower.lower_decode_graph`),
   with the lower-stage passes of the pass list in effect;
5. ``passes``: the program-stage passes, in order, by :class:`PassManager`.

Passes are the named scheduling passes of :mod:`nhil.compiler.schedule`
(``PASS_INFO``): ``lower``-stage ones change how the builder places and emits GEMVs,
``program``-stage ones are ``Program -> Program`` functions, ``command``-stage ones are
decisions of the timing model's command schedule. The default pipeline
(:data:`DEFAULT_PASSES`) is every default pass on (the opt-in ones, ``schedule.OPT_IN``, only when named); ``passes=()`` is the naive baseline. No pass
changes a computed value (``nhil.compiler.schedule``'s docstring;
``tests/test_pipeline.py`` checks each one alone and in the default pipeline).
``program.info["passes"]`` lists the enabled passes (the timing model reads the command
stage ones from it); :attr:`Compiled.pass_log` says per pass whether it changed the
program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, ContextManager, Iterable

from nhil.compiler.schedule import ORDER, PASS_INFO, PIPELINE, PassInfo
from nhil.errors import CompileError, NhilError, SetupError

DEFAULT_PASSES: tuple[str, ...] = PIPELINE  # every default scheduling pass, in pipeline order (not the opt-in ones)

StageFn = Callable[[str], ContextManager]


def _no_stage(name: str) -> ContextManager:
    return contextlib.nullcontext()


@dataclasses.dataclass
class PassRecord:
    """One pass of a compile: ``name``, ``stage``, whether it ``changed`` the program, instruction
    counts before/after (program-stage passes; lower/command-stage ones take effect inside the
    builder or the timing model, ``changed`` is None for them) and its wall time in seconds."""

    name: str
    stage: str
    changed: bool | None
    instrs_before: int | None = None
    instrs_after: int | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class PassManager:
    """An ordered pass list (names of :data:`nhil.compiler.schedule.PASS_INFO`, run in pipeline order).

    ``PassManager()`` is the default pipeline (every pass), ``PassManager([])`` the naive baseline.

    Usage::

        pm = PassManager(["row-locality", "gemv-batch"])
        prog = lower_decode_graph(gm, device, passes=pm.passes)  # lower-stage passes, explicitly
        prog = pm.run(prog)                 # program-stage passes; records info["passes"]
        pm.log                              # [PassRecord, ...]
        # or: pm.compile(lower_decode_graph, gm, device), which passes ``passes=`` itself

    Raises:
        SetupError: an unknown pass name (names the known ones).
    """

    def __init__(self, passes: Iterable[str] = DEFAULT_PASSES) -> None:
        passes = list(passes)
        bad = [n for n in passes if n not in PASS_INFO]
        if bad:
            raise SetupError(f"unknown scheduling pass(es) {', '.join(map(repr, bad))}; passes: {', '.join(ORDER)}")
        self.passes: tuple[str, ...] = tuple(n for n in ORDER if n in set(passes))
        self.log: list[PassRecord] = []

    @property
    def infos(self) -> list[PassInfo]:
        return [PASS_INFO[n] for n in self.passes]

    def run(self, program):
        """Run the program-stage passes in order on ``program`` (lowered with this pass list).

        Returns:
            The new Program, with ``info["passes"]`` = the enabled pass names; :attr:`log`
            gets one :class:`PassRecord` per pass.
        Raises:
            CompileError: a pass raised; the message names it and the passes that ran before it.
        """
        ran: list[str] = []
        self.log = []
        for info in self.infos:
            if info.fn is None:
                self.log.append(PassRecord(info.name, info.stage, None))
                ran.append(info.name)
                continue
            t0 = time.perf_counter()
            before = len(program.instrs)
            try:
                new = info.fn(program)
            except NhilError as e:
                raise CompileError(f"pass {info.name} ({info.stage} stage) failed: {e}; passes that ran before it: {', '.join(ran) or 'none'}") from e
            except Exception as e:  # noqa: BLE001 - a pass bug is reported with the pass named, not as a bare traceback
                raise CompileError(f"pass {info.name} ({info.stage} stage) failed: {type(e).__name__}: {e}; "
                                   f"passes that ran before it: {', '.join(ran) or 'none'}") from e
            self.log.append(PassRecord(info.name, info.stage, new.instrs != program.instrs, before, len(new.instrs), round(time.perf_counter() - t0, 4)))
            ran.append(info.name)
            program = new
        info = dict(program.info)
        info["passes"] = list(self.passes)
        return dataclasses.replace(program, info=info)

    def compile(self, compile_fn: Callable[..., Any], *args, **kw):
        """``compile_fn(*args, passes=self.passes, **kw)`` (a lowering entry point that takes the lower-stage pass list:
        ``lower_decode_graph``, ``compile_shape_only``), then :meth:`run`."""
        return self.run(compile_fn(*args, passes=self.passes, **kw))


@dataclasses.dataclass
class Compiled:
    """Everything one compile produced.

    Attributes:
        exported: the ``torch.export`` ExportedProgram of the decode step (None for a
            compile that started from a raised graph).
        raised: :class:`nhil.compiler.raising.RaisedGraph` (``.gm`` is the graph IR).
        plan: :class:`nhil.compiler.quantize.QuantPlan`, or None for bf16 weights.
        program: the :class:`nhil.isa.Program` after every pass.
        passes: enabled pass names, in pipeline order (= ``program.info["passes"]``).
        pass_log: one :class:`PassRecord` per pass.
        quant: the recipe string (``bf16``, ``native``, ``int4-g128:lm_head=bf16``, ...).
        max_cache_len: static KV-cache length the decode step was exported with.
    """

    exported: Any
    raised: Any
    plan: Any
    program: Any
    passes: tuple[str, ...]
    pass_log: list[PassRecord]
    quant: str = "bf16"
    max_cache_len: int = 0

    @property
    def gm(self):
        """The raised graph IR (``torch.fx.GraphModule``)."""
        return self.raised.gm


def export_and_raise(bundle, max_cache_len: int, stage: StageFn = _no_stage):
    """Stages 1-2: ``(exported program, raised graph)`` of ``bundle.model``'s decode step.

    Raises:
        CompileError: export or raising failed (names the op, module path and source line).
    """
    from nhil.compiler import export_decode, raise_graph

    with stage("export"):
        ep, _ = export_decode(bundle.model, max_cache_len)
    with stage("raise"):
        raised = raise_graph(ep, "decode")
    return ep, raised


def quant_plan(quant: str, raised, bundle):
    """Stage 3: the quantization plan of recipe ``quant`` over ``raised.gm`` (None for no recipe).

    ``native`` reads the checkpoint's own blocks, so it needs a GGUF source. :func:`compile`
    calls it for any recipe but ``bf16`` (whose program then carries no plan); the quant
    report calls it for ``bf16`` too, so that every row's program reports its weight bytes.

    Raises:
        SetupError / CompileError: unknown recipe, or a recipe the model cannot take.
    """
    if not quant:
        return None
    from nhil.compiler.quantize import build_plan

    src = str(getattr(bundle, "source", ""))
    return build_plan(quant, raised.gm, gguf_path=src if src.endswith(".gguf") else None, model=bundle.model,
                      checkpoint=getattr(bundle, "native", None))


def lower(raised, device, *, plan=None, passes: Iterable[str] = DEFAULT_PASSES, model_name: str = "?", stage: StageFn = _no_stage):
    """Stages 4-5: lower the raised graph with the lower-stage passes, then run the program-stage ones.

    Returns:
        ``(program, PassManager)`` (the manager's ``log`` holds the pass records).
    Raises:
        CompileError: an op without a lowering, the model does not fit the device, or a
            pass failed (named with the passes before it).
        SetupError: an unknown pass name.
    """
    from nhil.compiler.lower import lower_decode_graph

    pm = PassManager(passes)
    with stage("lower"):
        program = lower_decode_graph(raised.gm, device, model_name=model_name, quant=plan, passes=pm.passes)
        program = pm.run(program)
    return program, pm


def compile(bundle, device, quant: str = "bf16", passes: Iterable[str] = DEFAULT_PASSES, *, max_cache_len: int = 64,
            model_name: str | None = None, stage: StageFn = _no_stage) -> Compiled:
    """Compile ``bundle``'s decode step for ``device``: the whole pipeline (module docstring).

    Args:
        bundle: :class:`nhil.models.ModelBundle` (``.model`` is the transformers model).
        device: :class:`nhil.isa.DeviceConfig` (or a preset name).
        quant: weight recipe (``nhil.compiler.quantize``); ``bf16`` = no plan.
        passes: scheduling pass names (default: every pass).
        max_cache_len: static KV-cache length of the exported decode step (positions).
        model_name: recorded in ``program.info`` (default ``bundle.name``).
        stage: ``stage(name)`` -> context manager wrapped around each stage (export,
            raise, quantize, lower).

    Raises:
        SetupError: unknown device preset or pass; CompileError: any stage failed.
    """
    device = _device(device)
    ep, raised = export_and_raise(bundle, max_cache_len, stage)
    plan = None
    if quant not in (None, "", "bf16"):
        with stage("quantize"):
            plan = quant_plan(quant, raised, bundle)
    program, pm = lower(raised, device, plan=plan, passes=passes, model_name=model_name or bundle.name, stage=stage)
    return Compiled(ep, raised, plan, program, pm.passes, pm.log, quant or "bf16", max_cache_len)


def compile_shapes(config, device="aim-like", passes: Iterable[str] = DEFAULT_PASSES, max_cache_len: int = 128):
    """Shape-only compile of a large config (no weights; ``nhil.compiler.shape_only``) through the same pass manager.

    Returns:
        The Program (weights as shapes only: for the timing model, not for running).
    """
    from nhil.compiler.shape_only import compile_shape_only

    return PassManager(passes).compile(compile_shape_only, config, device=device, max_cache_len=max_cache_len)


def _device(device):
    from nhil.isa import DEVICE_PRESETS

    if isinstance(device, str):
        if device not in DEVICE_PRESETS:
            raise SetupError(f"unknown device preset {device!r}; presets: {', '.join(DEVICE_PRESETS)}")
        return DEVICE_PRESETS[device]
    return device
