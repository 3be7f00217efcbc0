"""Naming and classifying the torch calls the engine and the parameter guard intercept: ``Tensor``'s attribute
descriptors (torch's stubs type ``Tensor.grad`` as the tensor it returns, so ``Tensor.grad.__set__`` is named here
once, typed), and which ``Tensor.to`` / ``.cuda()`` / ``.cpu()`` calls move nothing (the no-op calls
``model.to(device)`` makes on tensors already where it sends them).

Pure classification of one torch call's arguments, no state. The parameter guard (``runtime.model.param_guard``)
serves such a call on an offloaded parameter without fetching it, and ``runtime.engine.clipping`` serves it on a
gradient's stand-in; both sit above this module, so it lives here, below them.
"""

from __future__ import annotations

from typing import Any

import torch

TO = torch.Tensor.to
CUDA = torch.Tensor.cuda


def tensor_getter(name: str) -> Any:
    """``Tensor.<name>.__get__``: what ``__torch_function__`` receives for a read of that attribute."""
    return getattr(torch.Tensor, name).__get__


def tensor_setter(name: str) -> Any:
    """``Tensor.<name>.__set__``: what ``__torch_function__`` receives for an assignment to that attribute."""
    return getattr(torch.Tensor, name).__set__


GRAD_GET = tensor_getter("grad")  # called directly (under DisableTorchFunctionSubclass): torch's own .grad
GRAD_SET = tensor_setter("grad")
GRAD_FN_GET = tensor_getter("grad_fn")
DATA_GET = tensor_getter("data")
DATA_SET = tensor_setter("data")


def same_device(wanted: torch.device, tensor: torch.Tensor) -> bool:
    """``wanted`` names the device tensor is on (an index left out matches any; the CPU's any index: there is one CPU
    device, which accelerate calls ``cpu:<local rank>`` in several processes, and the HF Trainer moves the model to)."""
    return wanted.type == tensor.device.type and (wanted.type == "cpu" or wanted.index in (None, tensor.device.index))


def no_op_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``t.cuda()`` of a tensor already on that device (``model.cuda()`` after offload)."""
    tensor = args[0]
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    if not tensor.is_cuda:
        return False
    if device is None:
        return True
    wanted = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return wanted.type == "cuda" and same_device(wanted, tensor)


def no_op_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``t.to(...)`` that returns t itself (same device and dtype, no copy), as ``model.to(device)`` calls it."""
    tensor = args[0]
    try:
        device, dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
    except (TypeError, RuntimeError):
        return False
    return (device is None or same_device(device, tensor)) and dtype in (None, tensor.dtype) \
        and not kwargs.get("copy", False)


def moves_nowhere(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``t.to(...)``, ``t.cuda()`` or ``t.cpu()`` that returns ``t`` itself: what ``model.to(device)`` calls on the
    tensors already there."""
    if func == TO:
        return no_op_to(args, kwargs)
    if func == CUDA:
        return no_op_cuda(args, kwargs)
    return func == torch.Tensor.cpu and args[0].device.type == "cpu"
