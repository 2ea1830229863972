"""``python -m fusec ...``: the ``fusec`` command (:func:`fusec.cli.main`) without an installed script."""
from fusec.cli import main

raise SystemExit(main())
