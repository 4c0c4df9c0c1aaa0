"""``python -m tailrl.cli COMMAND ...``: the ``tailrl`` command without its console script."""
from tailrl.cli import main

raise SystemExit(main())
