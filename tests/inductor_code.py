"""Read Inductor's generated wrapper code, for tests that check what order really runs.

The comm plan (``titan_simple/compile/comm_plan.py``) shows the order our pass chose in the FX graph.
Inductor's own scheduler could still move ops after that, so the tests also read the code Inductor generated.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from titan_simple.compile.inductor_private import run_and_get_code


def overlap_in_generated_code(fn: Callable[[], Any]) -> list[list[int]]:
    """Run ``fn``, which must trigger compilation, and read each generated graph's wrapper code. For each
    collective, in issue order, count the compute kernels (matmuls, fused C++ / Triton kernels) that run
    between its start and its wait."""
    _, codes = run_and_get_code(fn)
    result = []
    for code in codes:
        started: dict[str, int] = {}
        gaps: list[int] = []
        kernels = 0
        for line in code[code.find("def call"):].splitlines():
            if "_c10d_functional." in line and ("all_gather" in line or "reduce_scatter" in line
                                                or "all_reduce" in line):
                out = re.search(r"out=(\w+)", line) or re.match(r"\s*(\w+) = ", line)
                if out:
                    started[out.group(1)] = kernels
            elif (wait := re.search(r"wait_tensor\.default\((\w+)\)", line)) and wait.group(1) in started:
                gaps.append(kernels - started.pop(wait.group(1)))
            elif "extern_kernels." in line or re.search(r"\b(cpp|triton)_\w+(\.run)?\(", line):
                kernels += 1
        result.append(gaps)
    return result
