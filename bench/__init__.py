"""The issue-3 benchmark: the fill-mask server against the in-process ``transformers`` pipeline.

Run it with one command from the repository root (see ``bench/README.md``)::

    .venv/bin/python bench/run.py --sizes tiny,base --out bench/results

Modules: ``corpus`` (the mixed request texts), ``pipeline_limits`` (the in-process limits, run in a
child process), ``server_proc`` (the server as a subprocess, CPU accounting), ``loadgen`` (WebSocket
clients: closed loop, open loop, idle), ``probe`` (the ``/healthz`` prober, a child process),
``report`` (Markdown, JSON, plot) and ``run`` (the command line that ties them together).
"""
