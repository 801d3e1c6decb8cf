"""Fixtures for the tree-attention plugin tests.

The Triton kernels run on CPU through Triton's interpreter. `triton.jit` picks the interpreter when a function
is *decorated* with TRITON_INTERPRET=1 set, which normally means setting it before triton is imported. To keep
the process environment and the real `plugins.tree_attention.kernel` module (the ahead-of-time tests compile
it to PTX) untouched, `interpreted_kernel` instead
- loads plugins/tree_attention/kernel.py a second time, under a private module name, with the variable set
  only for that import, so its kernels are interpreter functions;
- while the fixture is active (one test module), swaps the @triton.jit helpers of triton.language that the
  kernels call (tl.max, tl.sum, tl.zeros, ...) for interpreter versions of the same Python functions, and
  fixes the interpreter's bf16 tl.dot (below). Everything is undone at teardown, including the patches the
  interpreter itself leaves on triton.language (it patches the language for every device-function call and
  never restores those), so later tests can still compile real kernels in this process.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Callable

import numpy as np
import pytest

import plugins.tree_attention as tree_attention_pkg

_PRIVATE_NAME = "_spectree_tree_attention_kernel_interpreted"


def _fix_interpreter_bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter stores bf16 as uint16 and its tl.dot multiplies those bit patterns (a documented
    interpreter limitation, triton-lang/triton#11584). On the GPU a bf16 dot multiplies bf16 values exactly
    into fp32 accumulators, so converting the operands to fp32 first reproduces the GPU arithmetic."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(x):
            if x.dtype.scalar != tl.bfloat16:
                return x
            data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)

        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _interpret_triton_stdlib(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # Import-time consumers of the stdlib JITFunctions (gluon re-wraps them, and triton.runtime.jit imports it
    # lazily at launch) must see the originals: import them before swapping.
    importlib.import_module("triton.experimental.gluon")
    interpreted: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("triton.language") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                replacement = interpreted.setdefault(id(value), InterpretedFunction(value.fn))
                monkeypatch.setattr(module, attr, replacement)


def _restore_interpreter_leaks(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Record the first (true) value of every attribute the interpreter patches, and the names it copies into
    triton.language module namespaces; the returned function puts all of it back."""
    from triton.runtime import interpreter

    missing = object()
    originals: dict[tuple[int, str], tuple[object, str, object]] = {}
    set_attr = interpreter._LangPatchScope.set_attr

    def recording_set_attr(self, obj, name, value):
        originals.setdefault((id(obj), name), (obj, name, vars(obj).get(name, missing)))
        set_attr(self, obj, name, value)

    monkeypatch.setattr(interpreter._LangPatchScope, "set_attr", recording_set_attr)
    namespaces = {name: set(vars(m)) for name, m in sys.modules.items() if name.startswith("triton.language") and m}

    def restore() -> None:
        for obj, name, original in originals.values():
            if original is missing:
                if name in vars(obj):
                    delattr(obj, name)
            else:
                setattr(obj, name, original)
        # The interpreter runs each function in its module's namespace after copying its own globals there.
        leaked = vars(interpreter)
        for name, keys in namespaces.items():
            module = sys.modules[name]
            for added in set(vars(module)) - keys:
                if added in leaked and vars(module)[added] is leaked[added]:
                    delattr(module, added)

    return restore


@pytest.fixture(scope="module")
def interpreted_kernel():
    """plugins/tree_attention/kernel.py with every @triton.jit kernel built for Triton's CPU interpreter."""
    pytest.importorskip("triton")
    path = f"{tree_attention_pkg.__path__[0]}/kernel.py"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.spec_from_file_location(_PRIVATE_NAME, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_PRIVATE_NAME] = module  # dataclasses in the module look themselves up here
        spec.loader.exec_module(module)
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(module.tree_attention_kernel, InterpretedFunction)
    with pytest.MonkeyPatch.context() as patch:
        restore = _restore_interpreter_leaks(patch)
        _interpret_triton_stdlib(patch)
        _fix_interpreter_bf16_dot(patch)
        try:
            yield module
        finally:
            restore()
    del sys.modules[_PRIVATE_NAME]
