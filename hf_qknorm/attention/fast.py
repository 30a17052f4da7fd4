"""A patched attention module's decoding forward: the upstream forward's own steps, with less host work per call.

Decoding one token runs every attention layer's forward once, and on a small model or a GPU the host's work per
call is what the step costs. The upstream forward of the Llama-shaped families calls each projection as a module
(``nn.Module.__call__``: hook checks, then ``forward``; a normalised projection's class adds its own frame), and the
patched classes add one more for the cap check. For these families this module makes the patched class's
``forward``: when no gradient is recorded and nothing is being compiled, it runs the upstream forward's steps
itself, and a projection that is a plain ``nn.Linear`` (or the patch's subclass of it) with no hook and nothing
replaced on it is one ``F.linear`` on its parameters, followed by the norm exactly as the subclass applies it
(:func:`~hf_qknorm.portable.hooks._normed`). Anything else -- a hook, a peft layer, an instance ``forward``, a
parametrization, a replaced ``nn.Linear.forward`` -- is called as a module, as upstream calls it. The cache
update, the attention backend (``ALL_ATTENTION_FUNCTIONS.get_interface``, whatever implementation is set) and the
output projection are the upstream forward's, called the same way, with the same arguments; the functions are looked
up in the family's module at every call, as upstream looks them up (a library that replaces ``apply_rotary_pos_emb``
or ``rotate_half`` is honoured). RoPE too, except for one position's fresh query and key (both made here by
``F.linear``, no module call having handed them to anyone) where the family's function is Llama's
(:func:`_llama_rope`: its source, and that of the ``rotate_half`` it calls, are Llama's): those are rotated in place
by the native op (:func:`~hf_qknorm.attention.native.rotary_in_place`), the same bits as Llama's ATen ops, one call
where those cost about twenty microseconds per layer per token. With a gradient, or under ``torch.compile``, the
upstream forward runs.

Only a forward whose source is one this module transcribes gets it: the upstream forward's signature and body,
comments and blank lines aside, must be Llama's (:data:`_BODY`), or Llama's with one ``sliding_window=`` argument to
the backend (Mistral, Qwen2: :data:`_WINDOW_LINES`). The same text has run from Transformers 5.4 to 5.23 in 40 of
its attention classes (Llama, Mistral, Qwen2, Qwen2-MoE, Gemma, Granite, Phi-MoE, Helium, GLM, ...); a version that
changes it gets the upstream forward until this module is taught the new text. The same logits to the bit as the
upstream forward, for every scheme and cache kind: ``tests/modeling/test_fast_forward.py``.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import torch
from torch import nn

from ..portable import hooks
from ..portable.hooks import (
    _LINEAR_FORWARD,
    _attn_implementation,
    _layer_norm,
    _layer_norm_params,
    _normed,
    _rowwise,
)
from .native import layer_norm_in_place, rotary_in_place

_F = torch.nn.functional

# The upstream forward this module transcribes: its parameters and its body, without comments or blank lines.
_PARAMETERS = ("self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values")
_BODY = """
input_shape = hidden_states.shape[:-1]
hidden_shape = (*input_shape, -1, self.head_dim)
query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
cos, sin = position_embeddings
query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
if past_key_values is not None:
    key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
    self.config._attn_implementation, eager_attention_forward
)
attn_output, attn_weights = attention_interface(
    self,
    query_states,
    key_states,
    value_states,
    attention_mask,
    dropout=0.0 if not self.training else self.attention_dropout,
    scaling=self.scaling,
    **kwargs,
)
attn_output = attn_output.reshape(*input_shape, -1).contiguous()
attn_output = self.o_proj(attn_output)
return attn_output, attn_weights
""".strip("\n")
# the backend's extra argument in the windowed variants (after ``scaling=self.scaling,``) -> what it passes
_WINDOW_LINES = {
    '    sliding_window=getattr(self.config, "sliding_window", None),': lambda self: getattr(
        self.config, "sliding_window", None
    ),
    "    sliding_window=self.sliding_window,": lambda self: self.sliding_window,
}
_ANCHOR = "    scaling=self.scaling,"

_MADE: dict[type, object] = {}  # base class -> its fast forward, or None


def _body(function) -> str | None:
    """``function``'s body without comments, blank lines or the ``def`` line, dedented; None where its source cannot
    be read."""
    try:
        lines, _ = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return None
    text = textwrap.dedent("".join(lines))
    tree_start = re.search(r"^\)\s*(->[^\n]*)?:\s*$", text, re.M)  # the end of a multi-line signature
    if tree_start is None:
        return None
    body = text[tree_start.end() :]
    kept = [re.sub(r"\s+#.*$", "", line).rstrip() for line in body.splitlines()]
    return textwrap.dedent("\n".join(line for line in kept if line.strip() and not line.lstrip().startswith("#")))


def _window(base: type):
    """None where ``base.forward`` is not a transcribed text; else what it passes as ``sliding_window`` (a function
    of the module, or False for the text without it)."""
    forward = base.__dict__.get("forward")
    if forward is None or not inspect.isfunction(forward) or hasattr(forward, "__wrapped__"):
        return None
    signature = inspect.signature(forward)
    names = tuple(signature.parameters)
    if names[:-1] != _PARAMETERS or signature.parameters[names[-1]].kind is not inspect.Parameter.VAR_KEYWORD:
        return None
    body = _body(forward)
    if body == _BODY:
        return False
    for line, value in _WINDOW_LINES.items():
        if body == _BODY.replace(_ANCHOR, f"{_ANCHOR}\n{line}"):
            return value
    return None


def fast_forward(base: type):
    """The decoding forward for a patched ``base`` (module docstring), or None where ``base``'s forward is not one
    this module transcribes. Made once per class."""
    if base not in _MADE:
        window = _window(base)
        _MADE[base] = None if window is None else _make(base, window)
    return _MADE[base]


def _plain_linear_params(module: nn.Module, projection_linear: type | None):
    """``module``'s ``(weight, bias)`` where calling it is ``F.linear`` on them (then, for the patch's subclass, its
    norms): an ``nn.Linear`` or the patch's subclass of it, no hook on it, no ``forward`` on the instance, its
    parameters its own; else None."""
    cls = type(module)
    if cls is not nn.Linear and cls is not projection_linear:
        return None
    own = module.__dict__
    if "forward" in own or own["_forward_hooks"] or own["_forward_pre_hooks"]:
        return None
    if own["_backward_hooks"] or own["_backward_pre_hooks"]:
        return None
    params = own["_parameters"]
    weight = params.get("weight")
    if weight is None or "bias" not in params:
        return None
    return weight, params["bias"]


def _project(attn, slot: str, x: torch.Tensor, shape, direct: bool, projection_linear: type | None):
    """``attn.<slot>(x)`` viewed as ``shape`` (``None``: as it is), by ``F.linear`` (and the patch's norm, one
    ``layer_norm`` on the heads where that is what the norm's call does) where that is what the call does; and
    whether the result is fresh: made here by ``F.linear`` (and normalised here), held by nothing else -- no module
    call, so no hook or module of another party has seen it."""
    module = attn.__dict__["_modules"][slot]
    params = _plain_linear_params(module, projection_linear) if direct else None
    if params is None:
        out = module(x)
        return (out if shape is None else out.view(shape)), False
    out = _F.linear(x, params[0], params[1])
    if type(module) is not projection_linear:
        return (out if shape is None else out.view(shape)), True
    own = module.__dict__
    plan = own.get("_qknorm_plan")  # (slot, norm attribute, head_dim): hooks._attach
    if shape is not None and own.get("_qknorm_owner") is attn and plan[0] == slot and plan[1] is not None:
        norm = attn.__dict__["_modules"][plan[1]]
        if plan[2] == shape[-1] and _rowwise(norm) == "layer_norm":
            norm_params = _layer_norm_params(norm, out.dtype)
            if norm_params is not None:  # the norm on the heads: the same values as on their rows (_normed)
                in_place = hooks.LAYER_NORM_IN_PLACE[0]  # out is F.linear's, fresh: as _normed(fresh=True) does
                if in_place is not None and in_place(out, plan[2], norm_params):
                    return out.view(shape), True
                return _layer_norm(out.view(shape), plan[2], norm_params), True
    out = _normed(module, out, True)  # F.linear's output, fresh; the norm's call may pass it to a hook
    return (out if shape is None else out.view(shape)), False


def _rope_code(function) -> str | None:
    """What ``function`` runs, for comparison: the syntax tree of its source without its docstring, decorators and
    annotations, its name aside; None for anything but a plain function with a source (a wrapper, a function an
    attribute was set on -- a kernel library's mark -- or one with free variables)."""
    if not inspect.isfunction(function) or function.__dict__ or function.__closure__:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for argument in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
        argument.annotation = None
    node.name, node.body, node.decorator_list, node.returns = "f", body, [], None
    return ast.dump(tree)


# Llama's ``apply_rotary_pos_emb`` and ``rotate_half`` as Transformers writes them (5.4 to 5.23), as :func:`_rope_code`
# gives them
_LLAMA_ROPE = tuple(
    ast.dump(ast.parse(text))
    for text in (
        """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
""",
        """
def f(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
""",
    )
)
_ROPES: dict = {}  # (apply_rotary_pos_emb, the rotate_half it calls) -> whether they are Llama's
_ROPES_MAX = 256


def _llama_rope(apply) -> bool:
    """Whether ``apply`` -- the family's ``apply_rotary_pos_emb``, looked up at the call -- computes what Llama's
    does: its code and that of the ``rotate_half`` it calls (looked up now, as it will be) are Llama's, and that
    ``torch`` is torch. Then :func:`~.native.rotary_in_place` gives its values to the bit. Decided once per pair."""
    rotate = getattr(apply, "__globals__", {}).get("rotate_half")
    key = (apply, rotate)
    known = _ROPES.get(key)
    if known is None:
        if len(_ROPES) >= _ROPES_MAX:
            _ROPES.clear()
        pair = (_rope_code(apply), _rope_code(rotate))
        known = _ROPES[key] = pair == _LLAMA_ROPE and rotate.__globals__.get("torch") is torch
    return known


def _make(base: type, window):
    upstream = base.forward
    family = upstream.__globals__  # the family's module: its RoPE, its backend registry, its eager attention
    module_state = torch.nn.modules.module

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        state = self.__dict__
        impl = _attn_implementation(self.config)  # ``self.config._attn_implementation``, cheaper
        if state.get("_qknorm_softcap") is not None:  # the capped class's check (hooks.attention_class)
            hooks.check_cap_backend(impl)  # looked up per call, as the capped class's forward does
        # with a gradient, compiling, or a window passed twice (upstream's own TypeError, after its cache update)
        if (
            torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or (window is not False and "sliding_window" in kwargs)
        ):
            return upstream(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        # a projection can be called as F.linear when nothing process-wide hooks module calls either
        direct = (
            hooks._DIRECT_CALLS
            and nn.Linear.forward is _LINEAR_FORWARD
            and not (
                module_state._global_forward_pre_hooks
                or module_state._global_forward_hooks
                or module_state._global_backward_pre_hooks
                or module_state._global_backward_hooks
            )
        )
        linear = hooks._PROJECTION_CLASSES.get(nn.Linear)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, fresh_query = _project(self, "q_proj", hidden_states, hidden_shape, direct, linear)
        key_states, fresh_key = _project(self, "k_proj", hidden_states, hidden_shape, direct, linear)
        value_states = _project(self, "v_proj", hidden_states, hidden_shape, direct, linear)[0].transpose(1, 2)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
        cos, sin = position_embeddings
        rope = family["apply_rotary_pos_emb"]
        # one position's fresh query and key rows: rotated in place, the same bits as Llama's function
        if not (
            fresh_query and fresh_key and _llama_rope(rope) and rotary_in_place(query_states, key_states, cos, sin)
        ):
            query_states, key_states = rope(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        attention_interface = family["ALL_ATTENTION_FUNCTIONS"].get_interface(impl, family["eager_attention_forward"])
        if window is not False:
            kwargs["sliding_window"] = window(self)
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return _project(self, "o_proj", attn_output, None, direct, linear)[0], attn_weights

    forward.__doc__ = f"{base.__name__}.forward's steps with less host work when decoding (hf_qknorm.attention.fast)."
    return forward


hooks.FAST_FORWARD[0] = fast_forward
hooks.LAYER_NORM_IN_PLACE[0] = layer_norm_in_place
