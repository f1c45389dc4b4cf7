"""Model zoo: architecture name -> builder of an eval-mode fp32 transformers model.

``get_model(name)`` returns a :class:`ModelBundle` (model, tokenizer or None, default
prompt ids, provenance). ``list_models()`` is what ``nhil models`` prints.
"""

from nhil.models.registry import ModelBundle, get_model, list_models, register

__all__ = ["ModelBundle", "get_model", "list_models", "register"]
