"""``python -m fillmask_client``: the ``fillmask-client`` command line."""

from .cli import main

raise SystemExit(main())
