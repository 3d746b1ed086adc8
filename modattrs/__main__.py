"""``python -m modattrs``: see ``python -m modattrs inspect --help``."""

from modattrs._cli.commands import main

raise SystemExit(main())
