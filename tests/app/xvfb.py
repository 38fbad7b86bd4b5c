"""A private X server (Xvfb) for the GUI tests, and screenshots of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from PIL import Image


@contextmanager
def xvfb_display(size: str = "1280x800x24") -> Iterator[str]:
    """Start Xvfb on a free display number (it picks one: -displayfd); yield ":N"."""
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb; setup.sh test does it)")
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write_fd), "-screen", "0", size, "-nolisten", "tcp"],
        pass_fds=(write_fd,),
        stderr=subprocess.DEVNULL,
    )
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        number = pipe.readline().strip()
    if not number:
        proc.kill()
        raise RuntimeError("Xvfb did not report a display number")
    try:
        yield f":{number}"
    finally:
        proc.terminate()
        proc.wait(10)


def screenshot(display: str, path: Path) -> Image.Image:
    """The whole screen as PNG via ImageMagick's `import` (saved for people to look at)."""
    if shutil.which("import") is None:
        pytest.skip("ImageMagick is not installed (apt-get install imagemagick)")
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["import", "-display", display, "-window", "root", str(path)], check=True, timeout=30
    )
    return Image.open(path)


def painted_colors(display: str, path: Path, timeout_s: float = 30.0, wanted: int = 50) -> int:
    """Screenshots until the screen shows more than `wanted` colours or the time is up.

    A window maps (and its page fires `load`) before the web view paints its first frame;
    one screenshot taken in between shows a blank window. Returns the last count.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        count = num_colors(screenshot(display, path))
        if count > wanted or time.monotonic() > deadline:
            return count
        time.sleep(0.5)


def num_colors(image: Image.Image) -> int:
    """Distinct colours: a blank or single-colour screen has one or two."""
    colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    return len(colors) if colors is not None else 1 << 20
