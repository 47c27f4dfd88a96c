"""Every tide Triton kernel that takes a batch-metadata index argument (`INDEX_ARGS`: positions,
cache slots, sequence and extend lengths, request rows, launch order) is not specialised on that
pointer's alignment. Those tensors are views whose 16-byte alignment changes with the batch, and a
kernel specialised on it compiles again in the middle of serving the first time an alignment is new
(measured: the first standard-workload run of a process on an H100 compiled the extend kernels again).
Skipped where triton is not installed (CI)."""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest

triton = pytest.importorskip("triton")


def _kernels():
    import tide.layers
    from triton.runtime.jit import JITFunction

    found = {}
    for info in pkgutil.walk_packages(tide.layers.__path__, "tide.layers."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.__module__ == info.name:
                found[f"{info.name}.{name}"] = obj
    return found


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter compiles nothing (its kernels are not JITFunctions)")
def test_index_arguments_are_not_specialised_on_alignment():
    from tide.layers.triton_ops import INDEX_ARGS

    kernels = _kernels()
    checked = 0
    for name, kernel in kernels.items():
        for param in kernel.params:
            if param.name in INDEX_ARGS:
                checked += 1
                assert param.do_not_specialize_on_alignment, (name, param.name)
    # The extend, decode, rope-and-store and batch-invariant kernels take them.
    assert checked >= 15, checked
    assert {"tide.layers.attention.triton_kernels._extend_kernel",
            "tide.layers.triton_ops._rope_store_kernel",
            "tide.layers.batch_invariant_triton._attention_kernel"} <= set(kernels)
