"""The vocabulary every layer of the runtime shares, and nothing that decides anything.

Owns: what a block is and how a model's parameters are grouped into blocks (``blocks``), turning SIGTERM into
the exception Ctrl-C raises and deferring interrupts around critical sections (``signals``), and the error type
a person reads without a traceback (``user_errors``). Leaves out: every policy; it imports no other runtime
package, so any layer may import it.
"""
