"""The Python client's old home, kept so that ``from fillmask_server.client import FillMaskClient`` and
``python -m fillmask_server.client`` go on working; the client is the ``fillmask_client`` package
(``clients/python``), which installs without the server's dependencies. New code imports that.

Only the public names are re-exported (the same objects, so ``except fillmask_server.client.FillMaskError``
catches what ``fillmask_client`` raises); the submodules live in ``fillmask_client`` only.
"""

from fillmask_client import *  # noqa: F403
