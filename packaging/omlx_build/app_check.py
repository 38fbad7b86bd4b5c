"""`build.py check-app`: what must hold in a built omlx.app before it ships.

The checks read files only (Info.plist, Mach-O headers, the bundle's site-packages), so
they run on Linux against a bundle laid out from the real macOS wheels; the signature
checks need macOS's codesign and live in signing.py.
"""

from __future__ import annotations

from pathlib import Path

from omlx_build.bundle_layout import app_plist, baked_version, bundle_site_packages
from omlx_build.grammar import root_problems
from omlx_build.macho import macho_files, min_macos
from omlx_build.project import BundleConfig
from omlx_build.strip import normalize_name

LIBMLX = "libmlx.dylib"
METALLIB = "mlx.metallib"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def metallib_problems(app: Path, site: Path) -> list[str]:
    """MLX finds mlx.metallib next to its own libmlx.dylib, so they must stay together."""
    libs = [p for p in app.rglob(LIBMLX) if not p.is_symlink()]
    problems = [
        f"{lib.relative_to(app)}: libmlx moved out of mlx/lib (MLX would fail to load "
        "its default metallib); copy mlx whole (bundle.toml [copy])"
        for lib in libs
        if lib.parent != site / "mlx" / "lib"
    ]
    if not (site / "mlx" / "lib" / LIBMLX).is_file():
        problems.append(f"{LIBMLX} is missing from {site.name}/mlx/lib")
    elif not (site / "mlx" / "lib" / METALLIB).is_file():
        problems.append(f"{METALLIB} is not beside {LIBMLX} in {site.name}/mlx/lib")
    return problems


def minos_problems(app: Path, minimum: str) -> list[str]:
    """Mach-O files that need a newer macOS than the bundle's LSMinimumSystemVersion."""
    problems = []
    for path in macho_files(app / "Contents"):
        needs = min_macos(path)
        if needs is not None and _version_tuple(needs) > _version_tuple(minimum):
            problems.append(
                f"{path.relative_to(app)} needs macOS {needs} but LSMinimumSystemVersion "
                f"is {minimum}: build on macOS {minimum} (pip picks wheels for the build "
                "machine's macOS) or raise minimum_macos in bundle.toml"
            )
    return problems


def package_problems(site: Path, config: BundleConfig) -> list[str]:
    problems = [
        f"{name} was not copied into {site.name}"
        for name in config.copy_packages
        if not (site / name).is_dir()
    ]
    stripped = {normalize_name(n) for n in config.strip}
    problems += [
        f"{entry.name} is in the bundle but bundle.toml [strip] removes it"
        for entry in site.iterdir()
        if normalize_name(entry.name.split("-")[0].removesuffix(".py")) in stripped
    ]
    problems += [
        f"{path.relative_to(site)}: debug symbols left in the bundle"
        for path in site.rglob("*.dSYM")
    ]
    return problems + [f"grammar: {p}" for p in root_problems(site)]


def app_problems(app: Path, config: BundleConfig) -> list[str]:
    """Everything wrong with the built ``app`` (empty when it is ready to sign)."""
    if not (app / "Contents" / "Info.plist").is_file():
        return [f"{app} is not an app bundle (no Contents/Info.plist)"]
    plist = app_plist(app)
    site = bundle_site_packages(app)
    problems = metallib_problems(app, site)
    problems += minos_problems(app, str(plist.get("LSMinimumSystemVersion", "0")))
    problems += package_problems(site, config)
    baked = baked_version(site)
    if baked != plist.get("CFBundleShortVersionString"):
        problems.append(
            f"the bundle's omlx reports version {baked!r}, Info.plist says "
            f"{plist.get('CFBundleShortVersionString')!r}: bake the version at build"
        )
    return problems
