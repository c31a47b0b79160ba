"""``python -m fillmask_server.client``: the ``fillmask-client`` command line (``fillmask_client.cli``)."""

from fillmask_client.cli import main

raise SystemExit(main())
