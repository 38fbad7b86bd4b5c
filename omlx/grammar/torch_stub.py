"""A minimal stand-in for ``torch`` so xgrammar imports without the ~500 MB wheel.

xgrammar 0.2.x declares torch but only needs it at import time: annotations
(``torch.Tensor``), ``bitmask_dtype = torch.int32`` and
``_FULL_MASK = torch.tensor(-1, dtype=torch.int32)``. omlx builds its bitmasks
with numpy (``get_bitmask_shape`` + ``fill_next_token_bitmask``), so nothing
here computes anything: helpers that would need real torch raise RuntimeError.

Call ``install()`` before the first ``import xgrammar``; it does nothing when
real torch is importable.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

STUB_VERSION = "0.0.0+omlx.stub"
WRITTEN_FOR_XGRAMMAR = (0, 2)

_DTYPE_NAMES = (
    "float16", "float32", "float64", "bfloat16",
    "int8", "int16", "int32", "int64", "uint8", "bool",
)  # fmt: skip
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64",
                  "short": "int16", "int": "int32", "long": "int64"}  # fmt: skip
_UNSUPPORTED = ("full", "zeros", "ones", "empty", "arange", "from_numpy", "as_tensor",
                "stack", "cat", "where")  # fmt: skip

_install_lock = threading.Lock()
_warn_lock = threading.Lock()
_warned_names: set[str] = set()
_installed: types.ModuleType | None = None


class dtype:  # lower-case like torch.dtype
    """A dtype token: compared and hashed by identity, like torch's."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class device:  # lower-case like torch.device
    def __init__(self, type: str, index: int | None = None) -> None:
        kind, _, idx = type.partition(":")
        self.type = kind
        self.index = int(idx) if idx else index

    def __repr__(self) -> str:
        suffix = "" if self.index is None else f", index={self.index}"
        return f"device(type={self.type!r}{suffix})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))


class Tensor:
    """An inert placeholder: it holds what ``torch.tensor`` was given and supports no ops."""

    def __init__(self, data: Any = None, dtype: dtype | None = None) -> None:
        self.data = data
        self.dtype = dtype
        self.device = device("cpu")

    def __repr__(self) -> str:
        return f"tensor({self.data!r}, dtype={self.dtype!r}) [omlx torch stub]"


class LongTensor(Tensor):
    pass


class FloatTensor(Tensor):
    pass


class IntTensor(Tensor):
    pass


class BoolTensor(Tensor):
    pass


class Module:
    """torch.nn.Module, so subclass definitions in optional code still import."""


def tensor(data: Any, *, dtype: dtype | None = None, **_: Any) -> Tensor:
    # Must not raise: xgrammar.matcher builds ``_FULL_MASK`` with it at import time.
    return Tensor(data, dtype)


def _unsupported(qualname: str) -> Callable[..., NoReturn]:
    def unsupported(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"{qualname}() needs real PyTorch, but omlx runs xgrammar without torch "
            "(omlx.grammar.torch_stub); use numpy bitmasks (xgrammar.get_bitmask_shape)"
        )

    unsupported.__name__ = unsupported.__qualname__ = qualname.rpartition(".")[2]
    return unsupported


def _warn_once(name: str) -> None:
    with _warn_lock:
        if name in _warned_names:
            return
        _warned_names.add(name)
    logger.warning(
        "torch stub: torch.%s is not stubbed (AttributeError); xgrammar or tvm_ffi wants it", name
    )


def _missing_attribute(name: str) -> NoReturn:
    # Import machinery and hasattr() probe dunders (__path__, __file__, ...): stay quiet.
    if not (name.startswith("__") and name.endswith("__")):
        _warn_once(name)
    raise AttributeError(f"module 'torch' has no attribute {name!r} (omlx torch stub)")


def _new_module(name: str, *, package: bool = False, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    module.__loader__ = None
    module.__package__ = name if package else name.rpartition(".")[0]
    if package:
        module.__path__ = []  # a package with no search path: unknown submodules don't import
    module.__dict__.update(attrs)
    return module


def _build_modules() -> dict[str, types.ModuleType]:
    dtypes = {name: dtype(name) for name in _DTYPE_NAMES}
    dtypes.update({alias: dtypes[name] for alias, name in _DTYPE_ALIASES.items()})
    dlpack = _new_module(
        "torch.utils.dlpack",
        to_dlpack=_unsupported("torch.utils.dlpack.to_dlpack"),
        from_dlpack=_unsupported("torch.utils.dlpack.from_dlpack"),
    )
    utils = _new_module("torch.utils", package=True, dlpack=dlpack)
    cuda = _new_module("torch.cuda", is_available=lambda: False, device_count=lambda: 0)
    version = _new_module("torch.version", __version__=STUB_VERSION, cuda=None, hip=None)
    nn = _new_module("torch.nn", package=True, Module=Module)
    torch = _new_module(
        "torch", package=True, __version__=STUB_VERSION, dtype=dtype, device=device,
        Size=tuple, Tensor=Tensor, LongTensor=LongTensor, FloatTensor=FloatTensor,
        IntTensor=IntTensor, BoolTensor=BoolTensor, tensor=tensor, cuda=cuda,
        version=version, nn=nn, utils=utils, __getattr__=_missing_attribute, **dtypes,
    )  # fmt: skip
    torch.__dict__.update({name: _unsupported(f"torch.{name}") for name in _UNSUPPORTED})
    return {m.__name__: m for m in (torch, cuda, version, nn, utils, dlpack)}


def _import_tvm_ffi_first() -> None:
    # tvm_ffi tries ``import torch`` while it imports; it must find none, not the stub.
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        logger.debug("tvm_ffi is not installed; xgrammar will fail to import on its own")


def _check_xgrammar_version() -> None:
    try:
        found = importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        return
    major_minor = tuple(int(part) for part in found.split(".")[:2] if part.isdigit())
    if major_minor != WRITTEN_FOR_XGRAMMAR:
        logger.warning(
            "torch stub was written for xgrammar %d.%d.x but %s is installed; "
            "a missing torch attribute will be logged by name",
            *WRITTEN_FOR_XGRAMMAR, found,
        )  # fmt: skip


def is_stub_active() -> bool:
    """True when ``sys.modules["torch"]`` is this stub."""
    return _installed is not None and sys.modules.get("torch") is _installed


def _real_torch_importable() -> bool:
    if "torch" in sys.modules:  # someone already imported a torch that is not ours
        return True
    return importlib.util.find_spec("torch") is not None


def install() -> bool:
    """Register the stub as ``torch``; True when this call installed it.

    False (and nothing changes) when real torch is importable or the stub is
    already active. Thread-safe; call it before the first ``import xgrammar``.
    """
    global _installed
    with _install_lock:
        if is_stub_active() or _real_torch_importable():
            return False
        # Only here, never with real torch: if tvm_ffi is imported after the stub it
        # would try to JIT-build its torch DLPack addon against this fake torch.
        os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"
        _import_tvm_ffi_first()
        modules = _build_modules()
        sys.modules.update(modules)
        _installed = modules["torch"]
    # Outside the lock: reading package metadata can be slow on a cold disk.
    _check_xgrammar_version()
    return True
