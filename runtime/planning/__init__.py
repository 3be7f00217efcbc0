"""Where each kind of training state lives, decided before anything is allocated: no hooks, no threads.

Owns: the memory plan (bytes per tier per kind of state) and its refusals (``memory_plan``), ``auto`` placement
from the machine's rates (``auto_placement``, ``rates``), placement from the first step's measured GPU peak
(``measured_placement``, ``peak_hint``), the host RAM this process may use (``hostmem``) and what to change after
an out-of-memory step (``oom_hint``). Leaves out: moving bytes (``engine``, ``update``) and the user's module
(``model``).
"""
