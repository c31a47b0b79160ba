"""``python -m fillmask_server.client``: the ``fillmask-client`` command line."""

from .cli import main

raise SystemExit(main())
