"""Fused CPU kernels for the language model's step (C++, built on the machine that runs them).

A decode step of a small model is mostly per-call cost: dozens of tiny PyTorch ops per layer,
each paying its own dispatch cost. ``cpu_kernels.cpp`` does the elementwise work of a layer in
four calls (residual add + RMSNorm, rotary, SiLU-and-multiply, KV write) and decode attention
reading the paged cache in place; ``build`` compiles it once per machine, ``ops`` is the
interface the model and the attention backend call, with a PyTorch implementation of the same
arithmetic wherever the kernels cannot be used (no compiler, float16, a GPU).
"""

from typing import Literal

# "auto": the fused CPU kernels where they apply (CPU, float32 or bfloat16) and build; "torch": never
KernelChoice = Literal["auto", "torch"]
