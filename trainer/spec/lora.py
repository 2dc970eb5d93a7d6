"""A LoRA adapter's settings: the spec's ``method.<type>.lora``, and what the sampler and the Tinker session build
adapters from (a module of its own, so that they need nothing else of the spec)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class LoraSpec(BaseModel):
    """LoRA adapter (Hu et al. 2021). ``target_modules``: ``all-linear`` (every linear layer but the LM head) or
    module names. Dropout defaults to 0 because, in RL, dropout makes the first importance ratio ≠ 1 and the KL
    noisy (TRL PR 3234)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    r: int = Field(16, ge=1, le=1024, description="rank, 1 to 1024")
    alpha: float = Field(32.0, gt=0, le=4096, description="scaling α (the update is scaled by α/r), up to 4096")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: (
        Literal["all-linear"]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(min_length=1, max_length=256)]
    ) = "all-linear"
