"""One training step, block by block: what happens at each hook, in order.

Owns: the controller that receives the hooks' events and dispatches them (``controller``), and the parts it hands
them to, each given the narrow collaborators it uses and a read-only view of the step (``step_view``): one record
per block (``block_state``), fetch / prefetch / release of the compute weights (``fetch``, over ``weights`` and the
prefetch ``schedule``), a finished block's gradient (``gradients``, with ``host_sums``, ``held_grads`` and
``kept_grads``), the commit (``commit``, with ``loss_scale`` and the groups' ``hypers``), state registered and moved
between tiers (``relocation``, ``spill_return``), clipping (``clipping``), state written back after device updates
(``writeback``); the step's phase and its legal moves (``step_phase``), its counters (``stats``), its options
(``options``) and the messages of its refusals (``refusals``); ``torch_calls`` names the torch calls intercepted.
Leaves out: the user's ``nn.Module`` (``model`` registers the hooks that call in) and the AdamW arithmetic
(``update``).
"""
