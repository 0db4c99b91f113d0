"""The base of every config section: frozen, unknown keys refused (``extra="forbid"``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
