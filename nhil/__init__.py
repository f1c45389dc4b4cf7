"""nhil: compiler and hardware-in-the-loop validation harness for a PIM LLM accelerator.

See ``README.md`` and ``docs/`` for the architecture; ``nhil --help`` for the command line.
"""

__version__ = "0.1.0"
