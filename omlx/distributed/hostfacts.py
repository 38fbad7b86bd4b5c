"""``python -m omlx.distributed.hostfacts --model NAME``: what ``omlx cluster check``
runs on each host (over ssh); prints the host's facts as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omlx.distributed.hosts import local_facts
from omlx.settings import load_settings


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omlx.distributed.hostfacts")
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-dir", action="append", dest="model_dirs", default=[])
    args = parser.parse_args()
    dirs = [Path(d) for d in args.model_dirs] or load_settings({}).model_dirs
    print(json.dumps(local_facts(args.model, dirs)))


if __name__ == "__main__":
    main()
