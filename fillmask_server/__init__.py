"""WebSocket streaming inference server for Hugging Face fill-mask models.

Modules, each one idea:
- ``protocol``: the wire format of protocol.md, pure (frame in, request or error out).
- ``session``: one connection's conversation, sans I/O (admission, in-flight table, cancel, deadlines).
- ``batching``: the batching policy, pure (queue in, next batch out).
- ``jobs``: an accepted request's states, the one table of legal moves, and its typed outcomes.
- ``items``: the values a batch is made of and gives back (``Item`` in, ``TopK`` out), no torch.
- ``model``: tokenizing, and the batched forward pass (top-k tensors) on the fast path proved at load.
- ``graph``: a batch's whole forward pass as one TorchScript call (lists in, top-k out);
  ``projection``: the output projection at the masks on oneDNN's packed kernel, where the load
  measures it faster than torch's own.
- ``loading``: ``--model`` to a checked ``FillMaskModel``; ``diagnosis``: why a model cannot load or
  serve, in one line for the operator.
- ``tokenizing``: a checked fast equivalent of a pure-Python tokenizer.
- ``intake``: the tokenizer stage's checks; ``decode``: top-k into the pipeline's predictions (JSON).
- ``core``: the engine's decisions, thread-free (admission, job containers, ledgers, the batch choice).
- ``costmodel``: a batch's predicted engine time, fitted online from the batches that ran, pure.
- ``engine``: the stages' threads (tokenizer, model, decode) around the core, and the hand-over.
- ``calibration``: what the engine measures at start-up (torch threads, cost model, a dtype's speed);
  ``tuning``: the torch thread count measured again while serving, pure; ``layout``: which layout
  (threads, parts) serves the most, and the second look at it while serving, pure; ``parts``: a
  batch's forward pass as parts side by side.
- ``cpus``: the CPUs this process may use, its affinity within its cgroups' CPU quota.
- ``connection``: one socket's ordered, byte-counted outbox.
- ``server``: the thin websockets shell (wiring, watchdog, drain); ``startup``: the start-up's lines and checks;
  ``launch``: the model loaded and calibrated, the server built (``load_server``, for a program that
  embeds it);
  ``signals``: what a shutdown signal means when it comes, pure; ``lifecycle``: the process's signal
  handlers, ready line and last words, in the order of its life.
- ``http``: the HTTP routes and the decision on each WebSocket handshake; ``front_connection``: websockets'
  connection as the server runs it (JSON refusals, held requests, messages handed over as parsed).
- ``access``: the handshake's Origin rule, shared token and TLS context, pure.
- ``metrics``: the Prometheus metrics of one server; ``stats``: the live figures of ``stats`` frames.
- ``allocator``: giving freed answer memory back to the system (glibc), and the garbage collector
  kept off what start-up made.
- ``config``: the one configuration dataclass, from flags and environment.
- ``checkpoint``: offline random-weight checkpoints for tests and benchmarks.
- ``client``: the old import path of the Python client, which is the ``fillmask_client`` package
  (clients/python; it also holds the wire constants both sides share, ``fillmask_client.wire``).
"""

__version__ = "0.1.0"
