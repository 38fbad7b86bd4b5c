"""omlx: a local LLM inference server on MLX."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("omlx")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
