"""`omlx quantize MODEL --level oQ4`: the job in-process, a text progress bar on stderr."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from omlx.errors import ModelNotFoundError
from omlx.quant.levels import DEFAULT_GROUP_SIZE, LEVELS, check_group_size, get_level
from omlx.quant.names import check_free, check_output_name, default_output_name
from omlx.settings import Settings

BAR_WIDTH = 30


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    quant = sub.add_parser("quantize", help="oQ mixed-precision quantization of a float model")
    quant.add_argument("model", help="model name in the model dirs, or a model folder path")
    quant.add_argument("--level", default="oQ4", help=f"one of {', '.join(LEVELS)}")
    quant.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE)
    quant.add_argument("--output", help="output folder name (default: <model>-<level>)")


class ProgressBar:
    """``measuring  [#########.........]  31%  0:42 left`` redrawn in place."""

    def __init__(self, out: TextIO = sys.stderr):
        self._out = out
        self._started = time.monotonic()
        self._last_draw = 0.0

    def __call__(self, phase: str, fraction: float) -> None:
        now = time.monotonic()
        if now - self._last_draw < 0.1 and fraction < 1.0:
            return
        self._last_draw = now
        filled = int(BAR_WIDTH * fraction)
        elapsed = now - self._started
        left = f"{_clock(elapsed * (1 - fraction) / fraction)} left" if fraction > 0.02 else ""
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        self._out.write(f"\r{phase:<11}[{bar}] {100 * fraction:3.0f}%  {left:<12}")
        self._out.flush()

    def close(self) -> None:
        if self._last_draw:
            self._out.write("\n")
            self._out.flush()
            self._last_draw = 0.0


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def _source(model: str, settings: Settings) -> tuple[str, Path, bool]:
    """(name, folder, whether its folder's own code may run: a served model's
    trust_remote_code setting; a folder given by path has none, so no)."""
    from omlx.models.discovery import discover_models
    from omlx.models.model_settings import ModelSettingsStore

    models = discover_models(settings.model_dirs)
    if model in models:
        own = ModelSettingsStore(settings.model_settings_path).get(model)
        return model, models[model].path, own.trust_remote_code
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path.name, path, False
    raise ModelNotFoundError(model, sorted(models))


def quantize_command(args: argparse.Namespace, settings: Settings) -> int:
    name, source, trust_remote_code = _source(args.model, settings)
    # Refuse bad input before importing MLX (a second or more).
    get_level(args.level)
    check_group_size(args.group_size)
    output = check_output_name(args.output or default_output_name(name, args.level))
    dest = check_free(settings.model_dirs[0] / output)
    from omlx.quant.job import QuantOptions, quantize_folder

    bar = ProgressBar()
    try:
        options = QuantOptions(
            level=args.level, group_size=args.group_size, trust_remote_code=trust_remote_code
        )
        result = quantize_folder(source, dest, options, bar)
    except KeyboardInterrupt:
        bar.close()
        print("omlx: quantization cancelled; no output written", file=sys.stderr)
        return 130
    finally:
        bar.close()
    print(f"{name} -> {result.output_path}")
    print(
        f"  size {result.size_bytes / 1e6:.1f} MB, {result.bits_per_weight:.3f} bits per weight "
        f"(target {result.target_bits_per_weight:.3f}), layers per width {result.bits_histogram}"
    )
    print(
        f"  held-out perplexity {result.perplexity_before:.3f} -> {result.perplexity_after:.3f}, "
        f"{result.elapsed_s:.1f} s"
    )
    return 0
