"""The bundled example model and its training text: what ``tierstore train`` trains with no arguments, and
what the benchmarks, tests and examples build without a download.

Owns: a small Llama-shaped decoder (``example_model``) and bytes of the Python standard library's source as text
(``data``). Leaves out: anything about offloading; it imports no other runtime package.
"""
