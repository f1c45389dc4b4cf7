"""Host side: host kernels, binding of position-relative instructions, step execution, generation loop."""

from nhil.runtime import host_recurrent  # noqa: F401  (registers the recurrent-layer host kernels)
from nhil.runtime.executor import Runner
from nhil.runtime.generate import StepOutputs, run_greedy, run_teacher_forced

__all__ = ["Runner", "StepOutputs", "run_greedy", "run_teacher_forced"]
