"""How many compiled variants the Triton kernels hold in this process: what a warm-up check counts.

Triton compiles a kernel once per combination of its `tl.constexpr` arguments, its argument dtypes and the
specialisations of its integer arguments (1, multiples of 16) and pointers (16-byte alignment). A serving
step that meets a new combination stalls for the compile; `worker.warmup` runs the combinations ahead, and
`loadtest.bench_engine` reports how many were still compiled during its run (0 is the goal).
"""

from __future__ import annotations

from types import ModuleType

import triton

from kernels import attention_decode_triton, attention_prefill_triton, sgmv_group_triton, sgmv_triton

MODULES: tuple[ModuleType, ...] = (
    attention_decode_triton,
    attention_prefill_triton,
    sgmv_group_triton,
    sgmv_triton,
)


def compiled_variants() -> dict[str, int]:
    """Compiled variants per kernel (`module.kernel`), on every device; empty under the interpreter."""
    return {name: len(keys) for name, keys in compiled_keys().items()}


def compiled_keys() -> dict[str, set[str]]:
    """Each kernel's compiled variants as Triton keys them (specialisations, constexprs, options)."""
    found: dict[str, set[str]] = {}
    for module in MODULES:
        for name, fn in vars(module).items():
            caches = (
                getattr(fn, "device_caches", None) if isinstance(fn, triton.runtime.JITFunction) else None
            )
            if caches is None:
                continue
            # Each device's entry is a tuple whose first item is the compiled-kernel cache (Triton 3.x).
            keys = {f"{device}:{key}" for device, entry in caches.items() for key in entry[0]}
            if keys:
                found[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = keys
    return found


def total_variants() -> int:
    return sum(compiled_variants().values())
