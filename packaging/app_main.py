"""py2app's entry script for omlx.app: the shell, or `omlx` / the window when asked."""

import sys

from app.main import main

sys.exit(main())
