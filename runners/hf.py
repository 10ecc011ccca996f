"""Hugging Face transformers, imported quietly.

Its import prints advice on stderr ("PyTorch was not found. Models won't be available ...")
and its loaders log warnings there: beside autotune's one-line errors that makes two lines, and
none of it is news to a user (a tokenizer and a config need no PyTorch). Errors still raise."""

from __future__ import annotations

import os
import warnings
from types import ModuleType

_QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def transformers() -> ModuleType:
    """The transformers module, its logging set to errors only. The environment is set only
    while it imports (where the advice is printed), so engines started later keep their logs."""
    saved = {key: os.environ.get(key) for key in _QUIET_ENV}
    os.environ.update(_QUIET_ENV)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformers as module
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    module.utils.logging.set_verbosity_error()
    return module
