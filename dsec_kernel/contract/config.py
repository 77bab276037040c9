"""What every driver's configuration is: a pydantic model with ``extra="forbid"`` (a
misspelt setting fails at start-up), named ``Config`` on the driver class and validated by
:func:`dsec_kernel.loader.load_driver`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["NoConfig"]


class NoConfig(BaseModel):
    """The configuration of a driver that takes none."""

    model_config = ConfigDict(extra="forbid")
