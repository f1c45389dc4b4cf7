"""``nhil landscape``: which causal-LM architectures of the installed transformers run on the nhil stack, and what to bring up next."""

from nhil.landscape.runner import DEFAULT_SUBSET, run_landscape

__all__ = ["run_landscape", "DEFAULT_SUBSET"]
