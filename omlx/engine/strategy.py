"""How a model's requests execute, chosen once per model load from what is known
about the backend, never inside a step. Pure: no MLX.

The fast paths (a lone request prefilled unbatched, its last chunk sampling the
first token in the same forward; our compiled decode steps for llama/qwen) were
measured faster on the CPU backend (benchmarks/README.md, "Figures behind
design choices"). On Metal they are unmeasured, so a GPU runs the plain path:
every request through the batched prefill and the eager batched decode, as
mlx-lm's BatchGenerator does, until a strategy is proven faster there
(``scheduler.execution_strategy`` picks one to measure it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StrategyName = Literal["auto", "plain", "fast_paths"]


@dataclass(frozen=True, slots=True)
class ExecutionStrategy:
    name: str
    # A lone request runs as a SoloSequence (one-pass last chunk) instead of a batch row.
    solo_prefill: bool
    # Compiled decode steps (compiled.py) for models that qualify.
    compiled: bool
    # Queue the next forward before handing out this step's tokens: free on a GPU,
    # a step of delay on the CPU backend (batch.py).
    pipelined: bool
    # The backend the model runs on ("cpu" or "gpu"): what the batch's budgets follow.
    device: str = "cpu"

    @classmethod
    def choose(cls, setting: StrategyName, device_type: str) -> ExecutionStrategy:
        """The strategy for a model loaded on ``device_type`` ("cpu" or "gpu")."""
        pipelined = device_type == "gpu"
        if setting == "auto":
            setting = "plain" if device_type == "gpu" else "fast_paths"
        fast = setting == "fast_paths"
        return cls(
            setting, solo_prefill=fast, compiled=fast, pipelined=pipelined, device=device_type
        )

    @classmethod
    def fast_paths(cls, *, compiled: bool = True, pipelined: bool = False) -> ExecutionStrategy:
        """The CPU's fast paths with compiled steps or pipelining switched (A/Bs, tests)."""
        return cls("fast_paths", solo_prefill=True, compiled=compiled, pipelined=pipelined)

    def split(self) -> ExecutionStrategy:
        """This strategy for a model split across ranks (omlx serve --distributed):
        eager, since the compiled steps assume whole layers."""
        return ExecutionStrategy(
            self.name, self.solo_prefill, False, self.pipelined, device=self.device
        )

    def describe(self) -> dict[str, object]:
        """For /health: which strategy each model runs."""
        return {
            "name": self.name,
            "solo_prefill": self.solo_prefill,
            "compiled": self.compiled,
            "pipelined": self.pipelined,
        }
