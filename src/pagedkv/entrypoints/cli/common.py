"""What every ``pagedkv`` subcommand shares with the ``pagedkv`` command itself.

Its own module so that subcommand modules never import main.py, which imports them: no import
circle, and one `CLIError` class whichever way the command starts (the console script or
``python -m pagedkv.entrypoints.cli``).
"""

from __future__ import annotations

from typing import Any


class CLIError(Exception):
    """A user-facing failure: ``main`` prints it as one line on stderr, exit code 2."""


def read_model_config(model: str | None) -> Any:
    """The `ModelConfig` of ``model`` (a .gguf, an HF config.json or a directory holding one;
    None: the default model) from its header only, no weights. Every way a user's file can be
    wrong (missing, unreadable, not JSON, missing keys) becomes a CLIError naming the file."""
    from pagedkv.models.config import load_model_config

    try:
        return load_model_config(model)
    except KeyError as e:
        raise CLIError(f"invalid model config {model!r}: missing key {e}") from None
    except (TypeError, AttributeError) as e:
        raise CLIError(f"invalid model config {model!r}: {e}") from None
    except (OSError, ValueError, NotImplementedError) as e:
        raise CLIError(str(e) if str(model) in str(e) else f"{model}: {e}") from None
