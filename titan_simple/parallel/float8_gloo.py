"""torchao's float8 tensor-parallel all-gathers on gloo: the float8 bits moved as bytes.

torchao's float8 TP styles all-gather ``DTensor(Float8TrainingTensor)`` activations; its op table then all-gathers
the float8 data tensor itself, which NCCL carries and gloo refuses ("Invalid scalar type": gloo has no float8
type). ``gather_float8_as_bytes`` wraps that one entry of torchao's op table (``float8_ops.FLOAT8_OPS_TABLE``, not a
public API: ``tests/test_float8.py`` fails if it moves) so that CPU tensors travel as uint8 and are waited for at
once (a wait on the float8 view could not find the uint8 collective's work). CUDA tensors take torchao's own path.
The trainer calls it only when float8 tensor parallel runs on gloo.
"""

from __future__ import annotations

import torch

_c10d = torch.ops._c10d_functional


def gather_float8_as_bytes() -> None:
    """Idempotent: wrap torchao's float8 all-gather so that CPU float8 bits travel as uint8."""
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE  # noqa: PLC0415 -- an optional dependency
    from torchao.float8.float8_training_tensor import Float8TrainingTensor  # noqa: PLC0415

    op = _c10d.all_gather_into_tensor.default
    original = FLOAT8_OPS_TABLE[op]
    if getattr(original, "moves_bytes_on_cpu", False):
        return

    def all_gather(aten_op, args, kwargs=None):
        fp8 = args[0]
        if fp8._data.device.type != "cpu":
            return original(aten_op, args, kwargs)
        data = fp8._data.contiguous()
        gathered = _c10d.wait_tensor(aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {})))
        return Float8TrainingTensor(gathered.view(data.dtype), fp8._scale, fp8._orig_dtype, fp8._linear_mm_config,
                                    fp8._gemm_input_role)

    all_gather.moves_bytes_on_cpu = True
    FLOAT8_OPS_TABLE[op] = all_gather
