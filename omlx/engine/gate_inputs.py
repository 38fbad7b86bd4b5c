"""What one engine's memory gate (memory_gate.StepGate) is told besides its own
model: the process's other work in flight (the MLX worker's other engines and
scoring tasks), a request's image transient, the image states it then holds and
its cached prompt tokens.

Nothing here refers back to the engine strongly: an unloaded model's weights are
freed when its last reference goes, not at the next garbage collection.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

from omlx.cache.prefix import PrefixCache
from omlx.engine.admission import AdmissionSwitch
from omlx.engine.image_prefill import usable_hit_tokens
from omlx.engine.memory_gate import StepGate
from omlx.memory.guard import MemoryGuard
from omlx.memory.vision import held_states, image_bytes, pixel_shapes, state_row_bytes
from omlx.scheduler import Request

if TYPE_CHECKING:
    from omlx.engine.model_engine import ModelEngine
    from omlx.engine.worker import Steppable
    from omlx.models.vlm import VisionEncoder


class ProcessWork(Protocol):
    """The MLX worker's view of the process's work (engine/worker.py)."""

    def running_besides(self, engine: Steppable | None) -> int: ...
    def progressing_besides(self, engine: Steppable | None) -> bool: ...
    def waiting_besides(self, engine: Steppable | None) -> float | None: ...


def step_gate(engine: ModelEngine, worker: ProcessWork, admission: AdmissionSwitch) -> StepGate:
    """The memory gate of ``engine``'s steps."""
    loaded, guard = engine.loaded, engine.guard
    return StepGate(
        engine.name,
        guard,
        engine.probe,
        elsewhere=_Elsewhere(worker, weakref.ref(engine)),
        image_bytes=partial(request_image_bytes, loaded.vision, guard),
        held_states=partial(request_held_states, loaded.vision),
        one_forward=partial(request_one_forward, loaded.vision),
        state_row_bytes=state_row_bytes(loaded.vision.dims) if loaded.vision else 0,
        cached_tokens=partial(_cached_tokens, engine.prefix_cache, loaded.vision),
        admission=admission,
    )


def _cached_tokens(
    prefix_cache: PrefixCache | None, vision: VisionEncoder | None, request: Request
) -> int:
    """Prompt tokens the runner will take from the prefix cache for ``request`` (MLX
    thread): what the index holds, less a hit an image prompt may not take."""
    if prefix_cache is None:
        return 0
    if request.images is None or vision is None:
        return prefix_cache.match(request.prompt_ids)
    held = prefix_cache.match(request.prompt_ids, request.images.keys)
    return usable_hit_tokens(vision, request.prompt_ids, held)


def request_image_bytes(vision: VisionEncoder | None, guard: MemoryGuard, request: Request) -> int:
    """The transient of encoding the request's images at prefill (0: none)."""
    if request.images is None or vision is None:
        return 0
    shapes = pixel_shapes(request.images.pixel_values)
    return image_bytes(vision.dims, shapes, request.num_prompt_tokens, guard.profile)


def request_held_states(vision: VisionEncoder | None, request: Request) -> int:
    """The image state rows the request holds while it runs (mllama's; 0: none)."""
    if request.images is None or vision is None:
        return 0
    shapes = pixel_shapes(request.images.pixel_values)
    return sum(held_states(vision.dims, shape) for shape in shapes)


def request_one_forward(vision: VisionEncoder | None, request: Request) -> bool:
    """Whether the request's prompt prefills in one forward, never in chunks: an image
    prompt of a family whose model attends it as one (Family.whole_prompt), or any
    prompt of one whose model attends text prompts so too (Family.whole_text_prompt)."""
    if vision is None or not vision.family.whole_prompt:
        return False
    return request.images is not None or vision.family.whole_text_prompt


def request_held_state_bytes(vision: VisionEncoder | None, request: Request) -> int:
    """The bytes of ``request_held_states``."""
    return request_held_states(vision, request) * state_row_bytes(vision.dims) if vision else 0


@dataclass(frozen=True, slots=True)
class _Elsewhere:
    """The process's work besides one engine's, as its gate asks (memory_gate.Elsewhere)."""

    worker: ProcessWork
    engine: weakref.ref[ModelEngine]

    def running(self) -> int:
        return self.worker.running_besides(self.engine())

    def progressing(self) -> bool:
        return self.worker.progressing_besides(self.engine())

    def waiting_since(self) -> float | None:
        return self.worker.waiting_besides(self.engine())
