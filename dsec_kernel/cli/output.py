"""How ``dsec`` commands print models for a program: ``--json``'s one object per line."""

from __future__ import annotations

import base64
import json
from typing import Any

__all__ = ["json_line", "plain"]


def plain(value: Any) -> Any:
    """``value`` (a model's python dump) with bytes as text, or marked base64 if not UTF-8."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def json_line(obj: Any) -> None:
    """Print ``obj`` (a model, or plain data) as one line of JSON."""
    data = obj.model_dump(mode="python") if hasattr(obj, "model_dump") else obj
    print(json.dumps(plain(data), default=str))
