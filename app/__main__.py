from __future__ import annotations

import sys

from app.main import main

sys.exit(main())
