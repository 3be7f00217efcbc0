"""AdamW wherever it runs: the kernel, the host worker thread, device updates, speculation.

Owns: AdamW over a block's flat fp32 buffers (``adam``), the worker that takes a block's gradients from pinned
memory, runs the CPU update and publishes the new weights (``worker``), the GPU's share of the update
(``device_updates``), second buffers for updates that run before their step commits (``speculation``), and how
fast this machine runs the CPU's AdamW and the copies beside it (``rates``: the ``Rates`` planning is given), and
Adam's moments stored compactly (``optimizer.moment_dtype``): their formats (``moment_formats``), the update over
them (``moments``) and an opt-in compiled int8 CPU kernel (``moment_kernel``).
Leaves out: when a block's gradients are complete or a step commits (``engine`` decides and calls in).
"""
