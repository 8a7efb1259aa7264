"""JSON files a model folder holds (model_index.json, config.json), read with errors naming the file."""

from __future__ import annotations

import json
from pathlib import Path

from .family import ModelError


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from `path`; ModelError naming the file when it is absent, not JSON or not an object."""
    if not path.is_file():
        raise ModelError(f"{what}: '{path}' is missing; re-download it with the model.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"{what}: '{path}' is not valid JSON ({error}); the file is damaged: re-download it.") from None
    if not isinstance(data, dict):
        raise ModelError(f"{what}: '{path}' holds a JSON {type(data).__name__}, not an object; re-download it.")
    return data
