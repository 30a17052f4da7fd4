"""The kernel dispatch policy (hf_qknorm.attention.dispatch): scoped, nesting, per thread, restored on exit; the
fallback to the PyTorch path is warned once or, with ``use_fallback=False``, an error that names the reason; the
policy holds under ``torch.compile(fullgraph=True)``, where it is read when the graph is traced.

Calls go through the real ``"qknorm"`` interface function; which path ran is observed by spying on the kernels'
entry points (CPU tensors run the kernels under Triton's interpreter, as CI does)."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

import hf_qknorm
from hf_qknorm import kernels
from hf_qknorm.attention import KernelFallbackError, KernelPolicy, current_kernel_policy, dispatch, kernel_policy
from hf_qknorm.attention.interface import qknorm_attention_forward

ON_CPU = ("cuda", "cpu")
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not kernels.is_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by conftest without CUDA)",
)


class _Attn(torch.nn.Module):
    is_causal = True


def _qkv(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 9, 16, generator=g).to(dtype) for _ in range(3)]


def _forward(module=None, dtype=torch.float32, **kwargs):
    q, k, v = _qkv(dtype)
    return qknorm_attention_forward(module or _Attn().eval(), q, k, v, None, softcap=3.0, **kwargs)[0]


@pytest.fixture
def kernel_calls(monkeypatch):
    import hf_qknorm.kernels.attn_interface as api

    calls = []
    original = api.qknorm_attn_func
    monkeypatch.setattr(api, "qknorm_attn_func", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())


def test_default_policy_routes_cpu_to_the_pytorch_path(kernel_calls):
    assert current_kernel_policy() == KernelPolicy(devices=("cuda",), use_fallback=True)
    _forward()
    with kernel_policy(use_fallback=False):  # CPU is not a kernel device here: no fallback, no error
        _forward(dtype=torch.float64)
    assert kernel_calls == []


def test_policy_nests_and_restores():
    with kernel_policy(devices=ON_CPU) as outer:
        assert outer == KernelPolicy(devices=ON_CPU, use_fallback=True)
        with kernel_policy(use_fallback=False) as inner:  # devices kept from the enclosing block
            assert inner == current_kernel_policy() == KernelPolicy(devices=ON_CPU, use_fallback=False)
            with kernel_policy(devices=()):
                assert current_kernel_policy() == KernelPolicy(devices=(), use_fallback=False)
            assert current_kernel_policy() == inner
        assert current_kernel_policy() == outer
    assert current_kernel_policy() == KernelPolicy()


def test_policy_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with kernel_policy(devices=(), use_fallback=False):
            raise RuntimeError("boom")
    assert current_kernel_policy() == KernelPolicy()


def test_policy_is_per_thread():
    """Two threads inside different policies at the same time each see their own; a new thread starts from the
    default whatever the starting thread has set."""
    barrier, seen = threading.Barrier(2), {}

    def worker(name, devices):
        with kernel_policy(devices=devices):
            barrier.wait()  # both blocks are open now
            seen[name] = current_kernel_policy().devices
            barrier.wait()

    with kernel_policy(devices=(), use_fallback=False):
        threads = [threading.Thread(target=worker, args=("a", ON_CPU)), threading.Thread(target=worker, args=("b", ()))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert current_kernel_policy() == KernelPolicy(devices=(), use_fallback=False)
    assert seen == {"a": ON_CPU, "b": ()}


def test_bad_policy_values():
    with pytest.raises(ValueError, match="unknown device type 'mps'.*'cuda', 'cpu'"):
        KernelPolicy(devices=("cuda", "mps"))
    with pytest.raises(TypeError, match="use_fallback must be True or False"):
        with kernel_policy(use_fallback="no"):
            pass
    with pytest.raises(TypeError, match="devices must be a tuple"):
        KernelPolicy(devices=None)
    assert KernelPolicy(devices="cpu").devices == ("cpu",)  # one name is not a sequence of letters
    assert current_kernel_policy() == KernelPolicy()


@needs_interpreter
def test_devices_route_cpu_to_the_kernels_and_empty_forces_pytorch(kernel_calls):
    with kernel_policy(devices=ON_CPU):
        kernel = _forward()
    assert len(kernel_calls) == 1
    with kernel_policy(devices=()):
        torch_path = _forward()
    assert len(kernel_calls) == 1
    torch.testing.assert_close(kernel, torch_path, rtol=2e-5, atol=2e-5)


@needs_interpreter
@pytest.mark.parametrize(
    "case,match",
    [
        ("float64", r"dtype torch.float64 is not supported"),
        ("dropout", r"no attention dropout \(dropout=0.1\)"),
        ("weights", r"attention weights were requested"),
        ("no-interpreter", r"no CUDA device|Triton's interpreter"),
    ],
)
def test_no_fallback_raises_with_the_reason(case, match, kernel_calls, monkeypatch):
    kwargs = {
        "float64": dict(dtype=torch.float64),
        "dropout": dict(module=_Attn().train(), dropout=0.1),
        "weights": dict(output_attentions=True),
        "no-interpreter": {},
    }[case]
    if case == "no-interpreter":
        monkeypatch.delenv("TRITON_INTERPRET")
    with kernel_policy(devices=ON_CPU, use_fallback=False):
        with pytest.raises(KernelFallbackError, match=match + r".*use_fallback=False"):
            _forward(**kwargs)
    assert kernel_calls == []


@needs_interpreter
def test_fallback_warns_once_and_computes_on_the_pytorch_path(kernel_calls, fresh_warnings, caplog):
    caplog.set_level(logging.WARNING, logger="hf_qknorm.attention.dispatch")
    with kernel_policy(devices=ON_CPU):
        out = _forward(dtype=torch.float64)
        _forward(dtype=torch.float64)
        _forward(output_attentions=True)  # asked for explicitly: honoured without a warning
    assert kernel_calls == []
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "qknorm attention: using the PyTorch path on cpu because dtype torch.float64 is not supported "
        "by the Triton kernels (float16, bfloat16, float32)."
    ]
    with kernel_policy(devices=()):
        torch.testing.assert_close(out, _forward(dtype=torch.float64), rtol=0, atol=0)


def _traced_ops(fn, *args) -> set[str]:
    """The call targets Dynamo puts in the graph of ``fn(*args)`` (fullgraph=True)."""
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


@needs_interpreter
def test_policy_under_torch_compile_is_read_when_tracing():
    module = _Attn().eval()
    q, k, v = _qkv()

    def fn(q, k, v):  # output_attentions given: outside a model, Transformers' output capture cannot be traced
        return qknorm_attention_forward(module, q, k, v, None, softcap=3.0, output_attentions=False)[0]

    with kernel_policy(devices=ON_CPU):
        assert any("hf_qknorm.attn_fwd" in t for t in _traced_ops(fn, q, k, v))
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=1e-6, atol=1e-6)
    assert not any("hf_qknorm" in t for t in _traced_ops(fn, q, k, v))  # default policy: the PyTorch path
    with kernel_policy(devices=ON_CPU, use_fallback=False):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="dtype torch.float64 is not supported"):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(*(t.double() for t in (q, k, v)))
    torch._dynamo.reset()


@needs_interpreter
def test_compiled_model_follows_the_policy_it_was_traced_with():
    """A whole patched model, fullgraph: traced under the CPU-kernels policy its graph holds the kernels' op, once per
    layer, and it matches the eager PyTorch path."""
    from tests._support.tiny_models import VOCAB, tiny_model

    model = tiny_model("llama").eval()
    hf_qknorm.patch_model(model, "qk_norm_cap", norm="layernorm")
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with kernel_policy(devices=()):
            expected = model(ids).logits
        with kernel_policy(devices=ON_CPU):
            seen = []

            def backend(gm, example_inputs):
                seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
                return gm.forward

            torch._dynamo.reset()
            got = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
    torch._dynamo.reset()
    assert sum("hf_qknorm.attn_fwd" in t for t in seen) == model.config.num_hidden_layers
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4)


def test_top_level_names():
    assert hf_qknorm.kernel_policy is kernel_policy and hf_qknorm.KernelFallbackError is KernelFallbackError
