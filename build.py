"""Build the macOS app and disk image (thin driver; logic and data live in packaging/).

python build.py check        validate everything that can be checked on any OS
python build.py app          dist/omlx.app with py2app (macOS)
python build.py dmg          dist/omlx-VERSION.dmg with hdiutil (macOS)
python build.py dmg-layout   the image's structure with xorriso (Linux, for tests)
python build.py lock         packaging/macos-requirements.txt: the app's macOS package set
python build.py verify       the bundle's rules on that set's real macOS wheels (any OS)
python build.py install-verified   verify, then pip-install exactly those wheels (the Mac build)
python build.py check-app A  a built app: metallib, minimum macOS, version, signatures
python build.py check-dmg I  mount a DMG (macOS) and check its layout
python build.py pins --bundled | --version   values the macOS workflow installs / expects
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "packaging"))

from omlx_build.cli import main

if __name__ == "__main__":
    sys.exit(main())
