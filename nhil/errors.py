"""Errors that end a run at a named stage.

Every error a user can cause (bad input, missing package, unsupported op, corrupt file)
is one of these; the CLI prints ``str(err)`` without a traceback and maps the class to
the run outcome (``COMPILE_FAIL``, ``LOAD_FAIL``, ...), see ``docs/outcomes.md``.
"""


class NhilError(Exception):
    """Base class: a clear, user-facing error. ``outcome`` names the failing stage."""

    outcome = "CRASH"


class SetupError(NhilError):
    """A required package, file or tool is missing; the message says how to install it."""

    outcome = "LOAD_FAIL"


class CompileError(NhilError):
    """The compiler cannot lower the model (unsupported op, unmatched pattern, no fit)."""

    outcome = "COMPILE_FAIL"


class ProgramFormatError(NhilError):
    """A ``.pimb``/``.pims`` program is malformed, truncated, of another version, or has an unknown opcode."""

    outcome = "LOAD_FAIL"


class LoadError(NhilError):
    """A target refuses a program (missing capability, does not fit the device)."""

    outcome = "LOAD_FAIL"


class NotClaimed(NhilError):
    """The target does not claim what the program needs (an opcode or weight format missing
    from its ``capabilities()``): the run is SKIPPED, which is never counted as a pass."""

    outcome = "SKIPPED"


class RunError(NhilError):
    """A target failed while executing a program (bad address at run time, device error)."""

    outcome = "RUN_FAIL"


class LinkError(NhilError):
    """The link to a remote target failed (serial timeout, board reset, retries exhausted)."""

    outcome = "LINK_FAIL"


class GoldenError(NhilError):
    """A golden file is corrupt, stale, or belongs to another model/weights/prompt."""

    outcome = "LOAD_FAIL"
