"""oQ levels and the storage cost of MLX affine quantization. Pure: no mlx import.

MLX's affine quantization packs ``bits`` per weight into uint32 words and stores,
for every group of ``group_size`` weights, one scale and one bias in the weight's
own float dtype (checked: ``mx.quantize`` on float32 returns float32 scales and
biases, on float16 / bfloat16 16-bit ones). So b bits at group size g cost
``b + 2 * scale_bits / g`` bits per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from omlx.errors import InvalidRequestError

# What mx.quantize accepts in affine mode (1 is allowed but too lossy to offer).
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
# Scale and bias dtype of the common source checkpoints (float16 / bfloat16).
DEFAULT_SCALE_BITS = 16


@dataclass(frozen=True, slots=True)
class Level:
    """``target_bits``: the average packed bits per weight the plan may spend.

    For oQ3..oQ8 it equals the uniform b-bit model, so comparisons are at equal
    size; oQ2 aims a half bit higher (a uniform 2-bit model is unusable)."""

    name: str
    base_bits: int
    target_bits: float

    @property
    def candidate_bits(self) -> tuple[int, ...]:
        """One step below the base and everything above it: the planner's choices."""
        return tuple(b for b in SUPPORTED_BITS if b >= max(2, self.base_bits - 1))

    def target_bits_per_weight(
        self, group_size: int = DEFAULT_GROUP_SIZE, scale_bits: int = DEFAULT_SCALE_BITS
    ) -> float:
        return self.target_bits + 2 * scale_bits / group_size


LEVELS: dict[str, Level] = {
    level.name: level
    for level in (
        Level("oQ2", 2, 2.5),
        Level("oQ3", 3, 3.0),
        Level("oQ4", 4, 4.0),
        Level("oQ5", 5, 5.0),
        Level("oQ6", 6, 6.0),
        Level("oQ8", 8, 8.0),
    )
}


def get_level(name: str) -> Level:
    """The level called ``name``; InvalidRequestError (400) naming the valid ones."""
    level = LEVELS.get(name)
    if level is None:
        raise InvalidRequestError(
            f"unknown oQ level {name!r}; valid levels: {', '.join(LEVELS)}", param="level"
        )
    return level


def check_group_size(group_size: int) -> int:
    if group_size not in GROUP_SIZES:
        raise InvalidRequestError(
            f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, not {group_size}",
            param="group_size",
        )
    return group_size


def bits_cost(bits: int, group_size: int, scale_bits: int = DEFAULT_SCALE_BITS) -> float:
    """Stored bits per weight of ``bits``-bit affine quantization, scale and bias included."""
    return bits + 2 * scale_bits / group_size
