"""The patch-time self-check judges what it can judge and costs the model nothing: an exact model whose embedding has
a zero (padding) row is patched, a model where nothing can be judged is refused in one true line, a model the check
should refuse still is, and the check's backward leaves the model's gradients and memory alone. Expected values come
from the models' own tensors, never from the code under test."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import hf_qknorm
from hf_qknorm import UnsupportedModelError
from tests._support.tiny_models import tiny_config


def _model(family="llama", **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()


def _shift_q_after_rope(monkeypatch):
    """Llama's RoPE step adds a constant to q: not a rotation, so the per-row scale of the norm does not commute."""
    from transformers.models.llama import modeling_llama

    rotary = modeling_llama.apply_rotary_pos_emb

    def shifted(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q + 0.5, k

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", shifted)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", ["qk_norm_cap", "qkv_norm"])
def test_an_exact_model_with_a_padding_row_is_patched(family, scheme):
    """Transformers' resize-embeddings test model (issue 51): four tokens, the padding row zeroed by nn.Embedding."""
    model = _model(family, vocab_size=4, pad_token_id=3, hidden_size=32, intermediate_size=37)
    assert not model.get_input_embeddings().weight[3].any()
    hf_qknorm.patch_model(model, scheme)
    assert hf_qknorm.is_patched(model)


def test_the_probe_tokens_avoid_the_padding_id_and_zero_rows():
    model = _model(vocab_size=8, pad_token_id=3)
    with torch.no_grad():
        model.get_input_embeddings().weight[5] = 0
    seen = []
    model.get_input_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0].flatten()))
    hf_qknorm.patch_model(model, "qk_norm_cap")
    ids = set(torch.cat(seen).tolist())
    assert ids and not ids & {3, 5} and ids <= set(range(8))


def _prune_q_head(model, head=0):
    """Zero the q projection of one head in every layer (a pruned head): its q rows are zero at the norm's input."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight[head * attn.head_dim : (head + 1) * attn.head_dim] = 0


def test_zero_rows_of_the_norms_input_are_not_judged(monkeypatch):
    """A pruned head's zero q rows prove nothing either way: the exact model is patched. The same model with a
    transform after RoPE is still refused, on the rows that can be judged."""
    model = _model()
    _prune_q_head(model)
    hf_qknorm.patch_model(model, "qk_norm_cap")
    assert hf_qknorm.is_patched(model)
    _shift_q_after_rope(monkeypatch)
    model = _model()
    _prune_q_head(model)
    with pytest.raises(UnsupportedModelError, match="q rows at the attention backend"):
        hf_qknorm.patch_model(model, "qk_norm_cap")


@pytest.mark.parametrize("case", ["only_the_padding_token", "every_row_zero"])
def test_a_model_where_no_row_can_be_judged_is_refused_in_one_true_line(case):
    if case == "only_the_padding_token":
        model = _model(vocab_size=1, pad_token_id=0)
    else:
        model = _model(vocab_size=4)
        with torch.no_grad():
            model.get_input_embeddings().weight.zero_()
    with pytest.raises(UnsupportedModelError) as info:
        hf_qknorm.patch_model(model, "qk_norm_cap")
    message = str(info.value)
    assert "no q row could be judged" in message and "llama" in message and "\n" not in message
    assert "per-head norm of the projection" not in message  # the false verdict of issue 51
    assert not hf_qknorm.is_patched(model)


class _CreatedBytes(TorchDispatchMode):
    """Adds up the bytes of every storage an operator creates (an output sharing an input's storage -- a view, an
    in-place result -- is not new): an upper bound on what the operators had allocated at any moment."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def storages(tree):
            return {t.untyped_storage().data_ptr(): t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)}

        given = storages((args, kwargs))
        out = func(*args, **(kwargs or {}))
        self.total += sum(t.untyped_storage().nbytes() for ptr, t in storages(out).items() if ptr not in given)
        return out


def test_the_self_check_leaves_every_grad_as_it_was():
    """Patching a model whose parameters require grad gives none of them (nor the new norms) a .grad, and a
    pre-existing .grad is the same tensor with the same values afterwards."""
    model = _model()
    params = list(model.parameters())
    assert all(p.requires_grad for p in params)
    kept = model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, 0.25)
    hf_qknorm.patch_model(model, "qk_norm_cap")
    assert model.lm_head.weight.grad is kept and bool((kept == 0.25).all())
    assert all(p.grad is None for p in model.parameters() if p is not model.lm_head.weight)
    assert all(p.requires_grad for p in params)


def test_the_self_check_allocates_far_less_than_a_set_of_gradients():
    """Patching a model whose parameters require grad (a large vocabulary: embedding and head dominate) creates
    less than a quarter of the bytes of one gradient per parameter, all operators together."""
    model = _model(vocab_size=32768, hidden_size=256, intermediate_size=256)
    assert all(p.requires_grad for p in model.parameters())
    gradient_set = sum(p.numel() * p.element_size() for p in model.parameters())
    with _CreatedBytes() as created:
        hf_qknorm.patch_model(model, "qk_norm_cap")
    assert created.total < gradient_set / 4, (created.total, gradient_set)


@pytest.mark.parametrize("scheme", ["soft_cap", "qk_norm_cap"])
def test_a_frozen_model_is_patched_and_stays_frozen(scheme):
    """A model loaded for inference (no parameter requires grad) is patched, and its parameters keep
    requires_grad=False."""
    model = _model()
    own = list(model.parameters())
    model.requires_grad_(False)
    hf_qknorm.patch_model(model, scheme)
    assert hf_qknorm.is_patched(model)
    assert not any(p.requires_grad or p.grad is not None for p in own)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the backend's backward ran")


@pytest.mark.parametrize("frozen", [False, True])
def test_the_training_pass_runs_the_backends_backward(monkeypatch, frozen):
    """The check's backward goes through the attention backend whatever requires grad: a backend whose backward
    fails is refused, soft_cap (no new parameter) on a frozen model included."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    backend = ALL_ATTENTION_FUNCTIONS["qknorm"]

    def failing(module, query, key, value, attention_mask, **kwargs):
        out, weights = backend(module, query, key, value, attention_mask, **kwargs)
        return _FailingBackward.apply(out), weights

    # in the instance's own entries, removed afterwards (setitem on the interface would restore by adding one)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "qknorm", failing)
    model = _model()
    model.requires_grad_(not frozen)
    with pytest.raises(UnsupportedModelError, match="probe forward failed .RuntimeError: the backend's backward ran"):
        hf_qknorm.patch_model(model, "soft_cap")
