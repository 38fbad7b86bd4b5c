"""omlx: a local LLM inference server on MLX."""

from importlib.metadata import PackageNotFoundError, version

try:
    # Only in the app bundle: build.py writes it there, because py2app does not copy an
    # editable install's package metadata.
    from omlx._version import __version__ as __version__
except ImportError:
    try:
        __version__ = version("omlx")
    except PackageNotFoundError:  # a source tree that was never installed
        __version__ = "0.0.0"
