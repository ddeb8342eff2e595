"""An audit tool, not part of the suite: emulate a CPU whose kernels round differently for every shape.

    PYTHONPATH=tests python -m pytest -p kernel_jitter tests/test_tiers.py -k exact

While a test runs, every matrix product (linear, mm, bmm, einsum) and every reduction (sum, mean,
softmax) gets a perturbation of the size of a reordered sum, uniform in +-sqrt(n) u sum|terms|,
drawn from a generator seeded by the operation and its operands' shapes. The same operation on the
same shapes and values gives the same bits, as with any kernel; the same values in another shape
(a row in a batch of 1 and of 3) get other bits, as a CPU whose kernels are chosen by shape might
give. A reduction over a tensor's last dimension is perturbed by its values and length only, since
a row-wise kernel does each row alike whatever the number of rows.

So a comparison that is exact by construction (docs/numerics.md) still passes under it, and one that
only happens to be exact on this CPU fails. The perturbations are far larger than real kernels'
(a real reordered sum is usually off by much less than sqrt(n) u sum|terms|), so a tolerance may be
exceeded here and still hold on every CPU; its failures on exact comparisons are the signal. Known
false alarms: tests with integer inputs whose sums are exact in any order (tests/test_kernels.py),
and runs compared against a fixture computed outside the test (the perturbation is only on during
the test itself).
"""
from __future__ import annotations

import hashlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten._softmax.default, aten._log_softmax.default,
              aten.softmax.int, aten.log_softmax.int, aten.logsumexp.default}


def _shapes(a):
    if isinstance(a, torch.Tensor):
        return tuple(a.shape)
    if isinstance(a, (list, tuple)):
        return [_shapes(x) for x in a]
    return a


def _seed(func, args) -> int:
    key = repr((str(func), [_shapes(a) for a in args]))
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:7], "little")


def _magnitude(func, args, out) -> tuple[torch.Tensor, int] | None:
    """(sum of |terms| behind each output element, the sum's length), or None: not a reduction."""
    with torch.no_grad():
        if func is aten.linear.default:
            x, w = args[0], args[1]
            mag = x.abs().float() @ w.abs().float().t()
            if len(args) > 2 and args[2] is not None:
                mag = mag + args[2].abs()
            return mag.to(out.dtype), x.shape[-1]
        if func is aten.einsum.default:
            equation, operands = args[0].replace(" ", ""), args[1]
            inputs, output = equation.split("->")
            terms = inputs.split(",")
            sizes = {c: t.shape[i] for term, t in zip(terms, operands) for i, c in enumerate(term)}
            n = math.prod(sizes[c] for c in set("".join(terms)) - set(output))
            return torch.einsum(equation, *[t.abs().float() for t in operands]).to(out.dtype), n
        if func in MATMULS:
            bias, (a, b) = (args[0], args[1:3]) if func in (aten.addmm.default, aten.baddbmm.default) else (None, args[:2])
            mag = a.abs().float() @ b.abs().float()
            return (mag if bias is None else mag + bias.abs()).to(out.dtype), a.shape[-1]
    return None


class Jitter(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
            return out
        u = torch.finfo(out.dtype).eps / 2
        if func in REDUCTIONS:
            x = args[0]
            dims = args[1] if len(args) > 1 else -1
            dims = [d % max(x.dim(), 1) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            n = math.prod(x.shape[d] for d in dims) if x.dim() else 1
            if dims == [x.dim() - 1] and out.dtype == torch.float32:
                # row-wise: a pseudo-random function of the value and the row's length, not the position
                bits = out.detach().contiguous().view(torch.int32).to(torch.int64)
                r = (((bits * 2654435761 + n * 40503) >> 7) & 0xFFFF).to(out.dtype) / 32768.0 - 1.0
            else:
                g = torch.Generator().manual_seed(_seed(func, args))
                r = torch.rand(out.shape, generator=g, dtype=torch.float64).to(out.dtype) * 2 - 1
            with torch.no_grad():
                out.add_(r * out.abs() * (u * math.sqrt(n)))
            return out
        found = _magnitude(func, args, out)
        if found is None:
            return out
        mag, n = found
        g = torch.Generator().manual_seed(_seed(func, args))
        r = torch.rand(out.shape, generator=g, dtype=torch.float64).to(out.dtype) * 2 - 1
        with torch.no_grad():
            out.add_(r * mag * (u * math.sqrt(n)))
        return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with Jitter():
        yield
