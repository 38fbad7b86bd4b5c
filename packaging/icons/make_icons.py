"""Draw omlx's icons with Pillow: the app icon (.icns + 1024 px PNG), the Linux tray icon
and the macOS menu-bar template. The generated files are committed; rerun after edits:

    .venv/bin/python packaging/icons/make_icons.py
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
TOP, BOTTOM = (64, 108, 246), (132, 60, 214)


def _gradient(size: int) -> Image.Image:
    img = Image.new("RGBA", (size, size))
    draw = ImageDraw.Draw(img)
    for y in range(size):
        t = y / (size - 1)
        color = tuple(round(a + (b - a) * t) for a, b in zip(TOP, BOTTOM, strict=True))
        draw.line([(0, y), (size, y)], fill=(*color, 255))
    return img


def _glyph(draw: ImageDraw.ImageDraw, size: int, color: tuple[int, ...]) -> None:
    """An "o" ring with three rising bars inside: a model answering."""
    c, r, w = size / 2, size * 0.30, size * 0.075
    draw.ellipse([c - r, c - r, c + r, c + r], outline=color, width=round(w))
    bar_w, gap = size * 0.06, size * 0.035
    heights = (0.12, 0.20, 0.28)
    left = c - (3 * bar_w + 2 * gap) / 2
    base = c + size * 0.12
    for i, h in enumerate(heights):
        x = left + i * (bar_w + gap)
        draw.rounded_rectangle([x, base - size * h, x + bar_w, base], radius=bar_w / 2, fill=color)


def app_icon(size: int = 1024) -> Image.Image:
    # macOS icon grid: a rounded square inset ~10% with a soft corner radius.
    inset, radius = round(size * 0.098), round(size * 0.18)
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rounded_rectangle(
        [inset, inset, size - inset, size - inset], radius=radius, fill=255
    )
    icon = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    icon.paste(_gradient(size), (0, 0), mask)
    _glyph(ImageDraw.Draw(icon), size, (255, 255, 255, 255))
    return icon


def tray_icon(size: int = 64) -> Image.Image:
    icon = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).ellipse([1, 1, size - 2, size - 2], fill=255)
    icon.paste(_gradient(size), (0, 0), mask)
    _glyph(ImageDraw.Draw(icon), size, (255, 255, 255, 255))
    return icon


def menubar_template(size: int = 36) -> Image.Image:
    # Template images are black + alpha; AppKit tints them for light and dark menu bars.
    icon = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    _glyph(ImageDraw.Draw(icon), size, (0, 0, 0, 255))
    return icon


def main() -> None:
    big = app_icon(1024)
    big.save(HERE / "omlx-1024.png")
    big.save(HERE / "omlx.icns", sizes=[(16, 16), (32, 32), (128, 128), (256, 256), (512, 512)])
    tray_icon().save(HERE / "omlx-tray.png")
    menubar_template().save(HERE / "omlx-menubar-template.png")


if __name__ == "__main__":
    main()
