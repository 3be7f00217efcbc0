"""What ``offload()`` does to the user's ``nn.Module`` and what the user holds: hooks, parameters, optimizer.

Owns: every module and tensor hook, registered in one place (``hooks``), models built block by block from the
meta device (``materialize``), activations recomputed in the backward (``recompute``), parameters that stay safe
to read and write between steps (``param_guard``, ``state_access``) and the ``torch.optim.Optimizer`` the user
steps (``optimizer``). Leaves out: the step's own logic (``engine``) and where state lives (``planning``).
"""
