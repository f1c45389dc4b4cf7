"""``nhil verify``: compile a model, run it on a target, check it against the golden.

Stages (each timed; the report is rewritten after every stage so a crash or a hang
still leaves one): load model -> golden (reuse or generate) -> export -> raise ->
[quantize] -> lower (``nhil.compiler.pipeline``: one compile for every caller) ->
encode/decode ``.pimb`` -> load on target -> teacher-forced run -> free-running greedy run
-> reference (the device-numerics reference, teacher-forced) -> compare -> report.

Two tiers judge every run: the **tight tier** (``nhil.golden.tight``) requires every logit
and every captured activation to be bit-identical to the device-numerics reference
(``nhil.golden.quant_reference``), for bf16 and every quant recipe: "the target does what
the compiler meant"; the **accuracy tier** (``nhil.golden.accuracy``) compares with the
fp32 eager golden under the tolerance profile, telling near ties (top-1 margins and MoE
expert selections within the allowed noise) from failures: "the format / numerics keep
the model's accuracy". The outcome is one of ``docs/outcomes.md``:
COMPILE_FAIL, LOAD_FAIL, LINK_FAIL, RUN_FAIL, CRASH, MISMATCH, PASS.

Modules: ``options`` (:class:`VerifyOptions`, the Makefile variables), ``run`` (the run folder, its
report rewritten after every stage, stage timeouts, provenance), ``flow`` (:func:`verify`: the stages
in order), ``reference`` (the device-numerics reference the tight tier compares against),
``accuracy_checks`` (the accuracy tier's checks against the fp32 golden).
"""

from nhil.verify.flow import verify
from nhil.verify.options import PROFILE, SAVE_PROGRAM_MAX_BYTES, VerifyOptions
from nhil.verify.run import STAGE_TIMEOUTS, StageTimeout

__all__ = ["verify", "VerifyOptions", "PROFILE", "SAVE_PROGRAM_MAX_BYTES", "STAGE_TIMEOUTS", "StageTimeout"]
