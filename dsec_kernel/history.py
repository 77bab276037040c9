"""The edge's record of every command run in each of its sandboxes (one JSON line each)."""

from __future__ import annotations

import os
from pathlib import Path

from dsec_kernel.wire import CommandRecord

__all__ = ["History"]


class History:
    """``root/<sandbox id>.jsonl``, appended as commands finish; survives edge restarts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def record(self, sandbox_id: str, rec: CommandRecord) -> None:
        with open(self.root / f"{sandbox_id}.jsonl", "a") as f:
            f.write(rec.model_dump_json() + "\n")

    def read(self, sandbox_id: str) -> list[CommandRecord]:
        try:
            lines = (self.root / f"{sandbox_id}.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [CommandRecord.model_validate_json(line) for line in lines if line]

    def forget(self, sandbox_id: str) -> None:
        try:
            os.unlink(self.root / f"{sandbox_id}.jsonl")
        except FileNotFoundError:
            pass
