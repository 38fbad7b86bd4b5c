"""Build logic for the macOS app and disk image; build.py at the repo root drives it.

Not named `packaging` on purpose: that would shadow the PyPI package pip and setuptools use.
"""
