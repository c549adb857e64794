"""One platform per device (cpu.py, cuda.py): each declares its defaults, capabilities and
refusals (interface.py), and on the CPU its ISA level (isa.py). Code outside this package
asks the platform instead of comparing device names. No torch at import.

Modules: isa.py (the CPU's ISA ladder, importable from the kernels), interface.py,
cpu.py, cuda.py, and registry.py (``get_platform``, ``resolve_device``). This file imports
nothing, so the kernels can reach isa.py without reaching the platforms' own imports."""
