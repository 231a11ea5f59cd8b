"""Print the x86 instruction sets below the one ATen uses on this CPU (default < avx2 < avx512),
for make test to run the tests marked isa under each: `ATEN_CPU_CAPABILITY=avx2 pytest -m isa`."""

import torch

ORDER = ["default", "avx2", "avx512"]
native = torch.backends.cpu.get_cpu_capability().lower()
print(" ".join(ORDER[: ORDER.index(native)] if native in ORDER else []))
