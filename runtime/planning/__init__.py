"""Where each kind of training state lives, decided before anything is allocated: no hooks, no threads, no timing.

Owns: the one function from (the model's blocks, the config, the device, the machine's ``Rates``) to a placement and
its memory plan (``placement.resolve_plan``; ``offload()`` applies it and ``tierstore plan`` prints it), asked again
for a running session (``placement.placement_at_reserve``); the config's values it reads, resolved (``settings``); the
memory plan (bytes per tier per kind of state) and its refusals (``memory_plan``), of the model's blocks and what
the host can hold of it (``block_plan``); ``auto`` placement from the rates (``auto_placement``), placement from the
first step's measured GPU peak (``measured_placement``, ``peak_hint``), the host RAM this process may use
(``hostmem``) and what to change after an out-of-memory step (``oom_hint``). Leaves out: measuring the rates
(``runtime.update.rates``), moving bytes (``engine``, ``update``) and the user's module (``model``: the caller says
whether its layers can be recomputed, and hands the measured placement the recomputation to try).
"""
