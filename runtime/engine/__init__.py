"""One training step, block by block: what happens at each hook, in order.

Owns: the controller that receives the hooks' events and dispatches them (``controller``), the step's phase and
its legal moves (``step_phase``), the prefetch schedule (``schedule``), each block's compute weights on the GPU
(``weights``), gradients on their way to the host and their sums (``host_sums``, ``held_grads``,
``kept_grads``), clipping (``clipping``), state written back after device updates (``writeback``) and spilled
moments brought back (``spill_return``). Leaves out: the user's ``nn.Module`` (``model`` registers the hooks
that call in) and the AdamW arithmetic (``update``).
"""
