"""`build.py verify`: the bundle's rules, checked on the real macOS wheels of its package set.

Runs on any OS. Each check returns problems that say what to change; an empty list
means the rule holds for the files the app will contain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from importlib.machinery import PathFinder
from pathlib import Path

from modulegraph.util import imp_find_module
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from omlx_build import macho
from omlx_build.check import WORKFLOW
from omlx_build.grammar import root_problems
from omlx_build.plist import info_plist
from omlx_build.project import ROOT, BundleConfig, grammar_pins, load_config
from omlx_build.wheelset import (
    LOCK_FILE,
    WheelSet,
    mixed_families,
    project_requirements,
    staged_versions,
    wheel_set,
)

# Never in the app: omlx.grammar's torch stub stands in for torch (bundle.toml [strip]).
FORBIDDEN = ("torch", "triton", "functorch")
_LIBRARY_SUFFIXES = (".so", ".dylib")
# At most this many files are named per problem; the count says how many more.
_SHOWN = 8


@dataclass(frozen=True, slots=True)
class Verification:
    problems: list[str]
    sizes: list[tuple[str, str, int]]  # (name, version, bytes), largest first
    wheels: WheelSet


def _listed(paths: list[str]) -> str:
    more = f" (and {len(paths) - _SHOWN} more)" if len(paths) > _SHOWN else ""
    return ", ".join(paths[:_SHOWN]) + more


def darwin_environment(config: BundleConfig) -> dict[str, str]:
    """Marker values of the bundle's Python on macOS (every key PEP 508 defines)."""
    python = f"{config.python}.0"
    return {
        "sys_platform": "darwin", "platform_system": "Darwin", "os_name": "posix",
        "platform_machine": config.arch, "platform_release": config.minimum_macos,
        "platform_version": "", "implementation_name": "cpython",
        "implementation_version": python, "platform_python_implementation": "CPython",
        "python_version": config.python, "python_full_version": python, "extra": "",
    }  # fmt: skip


def _pairs(pins: dict[str, str]) -> str:
    return ", ".join(f"{name}=={version}" for name, version in sorted(pins.items()))


def requirement_problems(config: BundleConfig, root: Path, wheels: WheelSet) -> list[str]:
    """(a) The lock holds every requirement pyproject declares for macOS."""
    env = darwin_environment(config)
    problems = []
    for line in project_requirements(root):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        locked = wheels.lock.get(canonicalize_name(req.name))
        if locked is None or not req.specifier.contains(locked, prereleases=True):
            found = f"has {req.name} {locked}" if locked else f"has no {req.name}"
            problems.append(
                f"{LOCK_FILE} {found}; pyproject.toml requires {line!r} on macOS: "
                "run `python build.py lock`"
            )
    for family, members in mixed_families(wheels.lock).items():
        problems.append(
            f"{LOCK_FILE} mixes {family} releases ({_pairs(members)}): its distributions "
            "ship as one release; run `python build.py lock`"
        )
    for name, version in wheels.pins.items():
        locked = wheels.lock.get(canonicalize_name(name))
        if locked is not None and locked != version:
            problems.append(
                f"{LOCK_FILE} pins {name}=={locked} but setup.sh installs {name}=={version}"
            )
    return problems


def package_problems(config: BundleConfig, root: Path, staging: Path) -> list[str]:
    """(b) py2app finds every `packages` entry: py2app 0.28 looks each one up with
    modulegraph's imp_find_module, on sys.path with the repo root first (build_app)."""
    problems = []
    for name in config.py2app_packages:
        try:
            imp_find_module(name, [str(root), str(staging)])
        except ImportError as exc:
            problems.append(
                f"py2app cannot find bundle.toml [py2app] package {name!r} ({exc}; "
                "modulegraph's imp_find_module needs an __init__.py): a namespace package "
                "such as mlx belongs in [copy] packages, anything else in the lock"
            )
    return problems


def module_findable(name: str, paths: list[str]) -> bool:
    """Whether Python's own import system finds dotted ``name`` on ``paths`` (namespace
    packages such as PyObjCTools included: modulegraph follows imports the same way)."""
    search: list[str] | None = paths
    for part in name.split("."):
        spec = PathFinder.find_spec(part, search)
        if spec is None:
            return False
        search = list(spec.submodule_search_locations or [])
    return True


def include_problems(config: BundleConfig, staging: Path) -> list[str]:
    """Every [py2app] includes entry exists in the macOS set."""
    return [
        f"bundle.toml [py2app] includes {name!r}, which the macOS set does not have: "
        "add its distribution to pyproject's app extra and run `python build.py lock`"
        for name in config.py2app_includes
        if not module_findable(name, [str(staging)])
    ]


def copy_problems(config: BundleConfig, staging: Path) -> list[str]:
    """(c) [copy] packages exist, and every libmlx.dylib has mlx.metallib beside it inside
    a copied folder (MLX loads the metallib from its own library's folder)."""
    problems = [
        f"bundle.toml [copy] names {name!r} but no package of the macOS set has that folder"
        for name in config.copy_packages
        if not (staging / name).is_dir()
    ]
    libraries = sorted(staging.rglob("libmlx.dylib"))
    if not libraries:
        problems.append("no libmlx.dylib in the macOS set: is mlx-metal in the lock?")
    for library in libraries:
        where = library.relative_to(staging)
        if not (library.parent / "mlx.metallib").is_file():
            problems.append(
                f"mlx.metallib is not beside {where}: MLX would fail with "
                "'Failed to load the default metallib'"
            )
        if where.parts[0] not in config.copy_packages:
            problems.append(
                f"{where} is outside bundle.toml [copy] packages: py2app would move it into "
                "Contents/Frameworks, away from mlx.metallib"
            )
    return problems


def forbidden_problems(config: BundleConfig, staging: Path) -> list[str]:
    """(d) No torch, triton, functorch or [strip] package in the set."""
    banned = {canonicalize_name(n) for n in (*FORBIDDEN, *config.strip)}
    found = [
        f"{name} {version}" for name, version in staged_versions(staging).items() if name in banned
    ]
    found += [
        f"{entry.name}/"
        for entry in sorted(staging.iterdir())
        if entry.is_dir() and canonicalize_name(entry.name) in banned
    ]
    if not found:
        return []
    return [
        f"the macOS set contains {', '.join(found)}, which the app must not ship: find the "
        f"package in {LOCK_FILE} that requires it and drop it, or install that one --no-deps"
    ]


def grammar_problems(root: Path, staging: Path) -> list[str]:
    """(e) xgrammar and tvm_ffi present at exactly setup.sh's GRAMMAR_PKGS versions."""
    versions = staged_versions(staging)
    problems = [
        f"{name} in the macOS set is {versions.get(canonicalize_name(name), 'missing')}, "
        f"setup.sh's GRAMMAR_PKGS pins {version}"
        for name, version in grammar_pins(root).items()
        if versions.get(canonicalize_name(name)) != version
    ]
    return problems + [f"grammar package {problem}" for problem in root_problems(staging)]


def signing_problems(staging: Path) -> list[str]:
    """(f) The signing list (macho_files) holds every file macholib reads as Mach-O and
    every file named like a library."""
    signed = set(macho.macho_files(staging))
    compiled = [
        path
        for path in macho.regular_files(staging)
        if macho.parses_as_macho(path) or path.name.endswith(_LIBRARY_SUFFIXES)
    ]
    unsigned = sorted(str(p.relative_to(staging)) for p in compiled if p not in signed)
    if not unsigned:
        return []
    return [
        f"{len(unsigned)} compiled file(s) would ship unsigned (not in macho.macho_files): "
        f"{_listed(unsigned)}; notarization refuses unsigned code"
    ]


def minos_problems(config: BundleConfig, staging: Path) -> list[str]:
    """(g) No arm64 slice needs a newer macOS than the bundle's Info.plist promises
    (LSMinimumSystemVersion, from bundle.toml minimum_macos). The Mac build installs these
    very files (`build.py install-verified`), so the promise holds by construction."""
    promised = str(info_plist(config)["LSMinimumSystemVersion"])
    limit = Version(promised)
    too_new, no_arm64 = [], []
    for path in macho.macho_files(staging):
        minos = macho.min_macos(path)
        where = str(path.relative_to(staging))
        if minos is None:
            no_arm64.append(where)
        elif Version(minos) > limit:
            too_new.append((Version(minos), f"{where} (minos {minos})"))
    problems = []
    if too_new:
        names = [text for _version, text in sorted(too_new, reverse=True)]
        problems.append(
            f"{len(names)} Mach-O file(s) need a newer macOS than bundle.toml minimum_macos "
            f"{promised} (Info.plist LSMinimumSystemVersion): {_listed(names)}; lock a wheel "
            f"built for {promised} or raise minimum_macos"
        )
    if no_arm64:
        problems.append(f"Mach-O file(s) without an arm64 macOS slice: {_listed(no_arm64)}")
    return problems


# How the workflow must install the bundle's packages, and the way it must not: pip
# resolving the lock itself picks wheels for the runner's macOS, newer than the bundle's.
INSTALL_VERIFIED = "build.py install-verified"
_PIP_FROM_LOCK = re.compile(r"pip install[^\n]*-r\s+" + re.escape(str(LOCK_FILE)))


def workflow_problems(config: BundleConfig, root: Path) -> list[str]:
    """(h) The macOS workflow builds with the Python and build tools that were verified,
    and installs the verified wheel files, not a fresh resolution of the lock."""
    try:
        text = (root / WORKFLOW).read_text()
    except OSError as exc:
        return [f"cannot read {WORKFLOW}: {exc}"]
    wanted = [f"{tool}=={version}" for tool, version in config.build_tools.items()]
    wanted += [f'python-version: "{config.python}"', INSTALL_VERIFIED]
    problems = [
        f"{WORKFLOW} should contain {item!r} (bundle.toml [build], the verified set)"
        for item in wanted
        if item not in text
    ]
    if _PIP_FROM_LOCK.search(text):
        problems.append(
            f"{WORKFLOW} installs {LOCK_FILE} with pip, which picks wheels for the runner's "
            f"macOS (newer than {config.minimum_macos}): use `python {INSTALL_VERIFIED}`"
        )
    return problems


def staging_problems(config: BundleConfig, root: Path, staging: Path) -> list[str]:
    """The checks that look only at the unpacked macOS set (b-g)."""
    return [
        *package_problems(config, root, staging),
        *include_problems(config, staging),
        *copy_problems(config, staging),
        *forbidden_problems(config, staging),
        *grammar_problems(root, staging),
        *signing_problems(staging),
        *minos_problems(config, staging),
    ]


def package_sizes(staging: Path) -> list[tuple[str, str, int]]:
    """(name, version, bytes installed) per distribution, largest first."""
    sizes = []
    for dist in metadata.distributions(path=[str(staging)]):
        total = sum(f.size or 0 for f in dist.files or ())
        sizes.append((dist.metadata["Name"], dist.version, total))
    return sorted(sizes, key=lambda item: (-item[2], item[0].lower()))


def run_verify(root: Path = ROOT, config: BundleConfig | None = None) -> Verification:
    """Every check on the locked macOS set (downloaded once, then cached)."""
    config = config or load_config(root)
    wheels = wheel_set(config, root)
    problems = [
        *requirement_problems(config, root, wheels),
        *staging_problems(config, root, wheels.staging),
        *workflow_problems(config, root),
    ]
    return Verification(problems, package_sizes(wheels.staging), wheels)
