"""``python -m polymask.cli``."""

from . import main

raise SystemExit(main())
