"""A checkpoint that is never whole in memory: decoder blocks materialised one at a time from safetensors.

:class:`StreamedCheckpoint` builds two skeletons of the source model on the ``meta`` device (parameters take no
memory; buffers such as RoPE's ``inv_freq`` are computed for real, with ``accelerate.init_empty_weights``): the
original model and the same model patched with the scheme (:func:`hf_qknorm.patch_model` on the skeleton, as for a
conversion without calibration). :meth:`StreamedCheckpoint.block` materialises block ``i`` of both from the source
files -- the patched block from exactly the tensors a conversion writes for that layer (the ``qkv_norm`` fold of
the removed pre-norm into the projections included, :mod:`hf_qknorm.conversion.output.shards`), plus the norm values
given -- and :meth:`StreamedCheckpoint.release` returns their parameters to ``meta`` (buffers stay: computed once,
or small and read again). Every parameter, and every buffer the checkpoint stores (a router's trained
``e_score_correction_bias``), is read as ``from_pretrained`` reads it (:mod:`hf_qknorm.conversion.output.keys`: fused
experts, renamed tensors). The embeddings, final norm and
output head are materialised only to embed the calibration text and to score it (:meth:`StreamedCheckpoint.logits`: the
model's own forward after the blocks). Both models run on the ``"qknorm"`` attention backend, which reports the q
and k it attends over (the logit statistics) for every family. Peak memory is one block (twice: original
and patched) plus the activations, whatever the depth -- the way GPTQ-style tools quantise models larger than memory.

:meth:`StreamedCheckpoint.block_inputs` runs the skeleton's own forward with every block replaced by a recorder, so
each block later receives exactly the arguments the model's forward gives it (attention masks per layer type,
RoPE position embeddings, position ids), for every family, without re-implementing any model's forward.

**Streams.** A block may be handed a mutable mapping that every block of one forward shares (Gemma 3n's and Gemma
4's ``shared_kv_states``: a layer stores its keys and values there and a later layer attends over them instead of
its own). The streams a conversion moves through the blocks side by side -- the original model, the converted one
with each version of the new norms, the inputs a layer is fitted on -- are separate forwards, so each needs its own
copy: a recorded call holds a :class:`PerStream` in the mapping's place, and running a block names its stream
(:func:`run_block`), which hands it that stream's copy of the mapping (the same copy to every block of the stream).
A call run without a stream while it holds such a mapping is refused, never run on a mapping another stream
wrote. The fits run in the stream :data:`FIT`; after a layer's fit,
:func:`~hf_qknorm.conversion.calibration.localfit.store_shared` runs it once more with its final parameters, so
that a later layer reading what it stored is fitted on the keys the written model has.
"""

from __future__ import annotations

import copy
import math
from collections import UserDict
from collections.abc import MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ...modeling.patch import patch_model
from ...portable.families import Family, text_runner
from ...portable.layout import find_layers
from ...portable.names import ATTN_IMPLEMENTATION
from ...portable.schemes import QKNormConfig
from ...upstream import CACHE_NAMES
from ..output.forms import native_values, prenorm_forms
from ..output.shards import SourceWeights, WeightPlan, plan_weights, transform_tensor


class _Stop(Exception):
    """Raised by the last block's recorder: nothing after the blocks needs to run."""


FIT = "fit"  # the stream of the layer fits: each patched attention layer on the inputs it is fitted on


class StreamMapping(UserDict):
    """One stream's copy of a mapping the blocks of a forward share. Tensors stored in it are detached: a layer fit
    stores its keys on every step, and a graph kept in the mapping would outlive the step."""

    def __setitem__(self, key, value):
        if torch.is_tensor(value):
            value = value.detach()
        elif isinstance(value, tuple):
            value = tuple(v.detach() if torch.is_tensor(v) else v for v in value)
        super().__setitem__(key, value)


class PerStream:
    """A mutable mapping recorded in a block's arguments (module docstring): each stream gets its own copy of it,
    made from what it held when recorded, on the first block run in that stream."""

    def __init__(self, recorded: MutableMapping):
        self.recorded = recorded  # held: keeps its id unique while the recording's memo lives
        self.initial = dict(recorded)
        self.copies: dict[str, StreamMapping] = {}

    def get(self, stream: str) -> StreamMapping:
        if stream not in self.copies:
            self.copies[stream] = StreamMapping(self.initial)
        return self.copies[stream]


@dataclass
class BlockCall:
    """The arguments one block receives in one forward (the hidden states are passed separately)."""

    args: tuple
    kwargs: dict
    hidden_in_args: bool

    def bind(self, stream: str | None) -> BlockCall:
        """The call as stream ``stream`` runs it: each :class:`PerStream` replaced by that stream's copy."""
        if not any(isinstance(v, PerStream) for v in (*self.args, *self.kwargs.values())):
            return self
        if stream is None:
            raise RuntimeError(
                "a block call holding a mapping its forward's blocks share (shared_kv_states) was run without naming "
                "its stream"
            )
        pick = lambda v: v.get(stream) if isinstance(v, PerStream) else v  # noqa: E731
        return BlockCall(
            tuple(pick(a) for a in self.args), {k: pick(v) for k, v in self.kwargs.items()}, self.hidden_in_args
        )


def _per_stream(value, memo: dict):
    """``value``, or the :class:`PerStream` standing for it where it is a mutable mapping (one per recorded
    mapping: every block of a forward gets the same)."""
    if isinstance(value, MutableMapping):
        if id(value) not in memo:
            memo[id(value)] = PerStream(value)
        return memo[id(value)]
    return value


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    if leaf in target._buffers:  # a buffer the checkpoint stores (a router's e_score_correction_bias): its own dtype
        target._buffers[leaf] = value.to(target._buffers[leaf].dtype)
    else:
        target._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def _stored_buffers(model: nn.Module) -> list[str]:
    """The names of ``model``'s buffers that its state dict holds (the persistent ones): a checkpoint may store them."""
    keys = model.state_dict().keys()
    return [name for name, _ in model.named_buffers(remove_duplicate=False) if name in keys]


def _release_parameters(module: nn.Module) -> None:
    """Every parameter of ``module`` back on ``meta``; its buffers stay (the computed ones, RoPE's ``inv_freq``,
    are not read again; the stored ones are read again with the block)."""
    for sub in module.modules():
        for leaf, prm in sub._parameters.items():
            if prm is not None:
                sub._parameters[leaf] = nn.Parameter(prm.to("meta"), requires_grad=False)


class StreamedCheckpoint:
    """The original and the patched model of a source checkpoint, materialised block by block (see the module
    docstring). ``values`` (state-dict name -> tensor) are the new norms' values the patched blocks are built with."""

    def __init__(self, config, family: Family, weights: SourceWeights, cfg: QKNormConfig, device: torch.device):
        from accelerate import init_empty_weights

        from ...modeling.saved import auto_class

        self.family, self.weights, self.cfg, self.device = family, weights, cfg, device
        with init_empty_weights(include_buffers=False):  # each its own copy: the backend set below is not the source's
            self.original = auto_class(config).from_config(copy.deepcopy(config), dtype=torch.float32)
            self.patched = auto_class(config).from_config(copy.deepcopy(config), dtype=torch.float32)
        patch_model(self.patched, cfg)
        for model in (self.original, self.patched):
            # the backend that hands over what it attends over (the logit statistics), for every family
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            model.eval()
            for buf_owner in model.modules():
                for key, buf in list(buf_owner._buffers.items()):
                    if buf is not None and buf.device != device:
                        buf_owner._buffers[key] = buf.to(device)
        # the head shares the embedding's weight (a multimodal model may say so in its own config, not the text one):
        # read off the source's skeleton, which Transformers tied (init_empty_weights above leaves them apart)
        skeleton = weights.model if weights.model is not None else self.original
        head, embed = skeleton.get_output_embeddings(), skeleton.get_input_embeddings()
        self._tied = head is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0)
        # the buffers the checkpoint stores, read with the parameters (a router's trained e_score_correction_bias)
        self._stored = {m: [n for n in _stored_buffers(m) if weights.has(n)] for m in (self.original, self.patched)}
        self.blocks = find_layers(self.original, family)
        self.patched_blocks = find_layers(self.patched, family)
        # the model's forward takes a block's output as a tuple and reads its first entry (Falcon-H1's): seen by
        # :meth:`block_inputs` when the second block is handed the first entry of what the first one returned
        self._tuple_outputs = False
        self.prefix = family.layers + "."
        # the qkv_norm fold of every layer (tiny vectors: gains and bias shifts), and the dropped pre-norm tensors
        forms = prenorm_forms(self.original, family, weights) if cfg.removes_prenorm else None
        self.plan: WeightPlan = plan_weights(weights, family, cfg, {}, forms)
        self._top1: dict = {}  # the reference stream's next-token choices, by (tensor id, row): _reference_top1

    def native_values(self, i: int) -> dict:
        """The values the scheme's norms of layer ``i`` start from where they replace the model's own per-head norms
        (:func:`hf_qknorm.conversion.output.forms.native_values`); empty for other models."""
        return native_values(self.original, self.patched, self.family, self.weights, i)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def reusing(self) -> tuple[int, ...]:
        """The layers with no key projection of their own (attending over an earlier layer's keys)."""
        from ...portable.families import reusing_layers

        return reusing_layers(self.blocks, self.family)

    # --- loading ------------------------------------------------------------------------------------------------
    def _load(self, model: nn.Module, names, transform: bool = False, values: dict | None = None) -> None:
        for name in names:
            if values is not None and name in values:
                tensor = values[name].clone()  # the block's parameter must never share memory with the caller's
            else:  # the qkv_norm fold is planned on the checkpoint's tensors, before any split or fusion
                fold = (lambda key, t: transform_tensor(key, t, self.plan)) if transform else None
                tensor = self.weights.read_param(name, fold)
            _set_tensor(model, name, tensor.to(device=self.device, dtype=torch.float32))

    def _names(self, model: nn.Module, prefix: str | None, outer: bool = False) -> list[str]:
        """The parameters of a block (``prefix``) or outside every block (``outer``), and the buffers there that the
        checkpoint stores: ``from_pretrained`` reads those too, and a block's forward may use them (a router's
        ``e_score_correction_bias``, trained, where a skeleton holds zeros)."""
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        names += self._stored[model]
        if outer:
            return [n for n in names if not n.startswith(self.prefix)]
        return [n for n in names if n.startswith(prefix)]

    def block(self, i: int, values: dict) -> tuple[nn.Module, nn.Module]:
        """Materialise block ``i``: ``(original, patched)``, the patched one with the norm ``values``."""
        prefix = f"{self.prefix}{i}."
        self._load(self.original, self._names(self.original, prefix))
        self._load(self.patched, self._names(self.patched, prefix), transform=True, values=values)
        return self.blocks[i], self.patched_blocks[i]

    def layer_values(self, values: dict, i: int) -> dict:
        """The entries of ``values`` (by state-dict name) that belong to block ``i``."""
        prefix = f"{self.prefix}{i}."
        return {k: v for k, v in values.items() if k.startswith(prefix)}

    def layers(self, values: dict):
        """Every block in turn: block ``i`` materialised with its entries of ``values`` (read as the loop reaches
        it), ``(i, original, patched)`` yielded, and the block released when the loop moves on."""
        for i in range(self.num_layers):
            original, patched = self.block(i, self.layer_values(values, i))
            yield i, original, patched
            self.release(i)

    def set_values(self, values: dict) -> None:
        """Copy new norm values into the materialised patched block(s) they belong to."""
        with torch.no_grad():
            for name, value in values.items():
                self.patched.get_parameter(name).copy_(value)

    def release(self, i: int) -> None:
        _release_parameters(self.blocks[i])
        _release_parameters(self.patched_blocks[i])

    @contextmanager
    def outer(self):
        """Embeddings, final norm and output head of the original model, materialised while in the block (of a
        multimodal model also its vision tower and projector, which its forward on text does not run, but whose
        device it may read)."""
        names = self._names(self.original, None, outer=True)
        tied = self._tied or getattr(self.original.config.get_text_config(), "tie_word_embeddings", False)
        head = self.original.get_output_embeddings()
        head_name = next(f"{n}.weight" for n, m in self.original.named_modules() if m is head)
        loadable = [n for n in names if self.weights.has(n)]
        # made on loading by an operation the conversion does not reproduce, outside the language model (a vision
        # tower's fused q/k/v): zeros, which a forward on text never reads -- the written folder is checked against
        # the source as Transformers loads it
        opaque = [n for n in names if n in self.weights.names.opaque]
        missing = sorted(set(names) - set(loadable) - set(opaque) - ({head_name} if tied else set()))
        if missing:
            raise ValueError(f"{self.weights.folder}: the checkpoint lacks {missing}")
        self._load(self.original, loadable)
        for n in opaque:
            shape = self.original.get_parameter(n).shape
            _set_tensor(self.original, n, torch.zeros(shape, device=self.device, dtype=torch.float32))
        if tied and head_name not in loadable:
            head.weight = self.original.get_input_embeddings().weight
        try:
            yield self.original
        finally:
            self._top1.clear()
            for n in names:
                owner, _, leaf = n.rpartition(".")
                module = self.original.get_submodule(owner)
                if leaf in module._parameters:  # a stored buffer stays, like a block's
                    module._parameters[leaf] = nn.Parameter(module._parameters[leaf].to("meta"), requires_grad=False)

    # --- running ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def block_inputs(self, ids: torch.Tensor, batch_size: int) -> tuple[list[torch.Tensor], list[list[BlockCall]]]:
        """The first block's input hidden states for ``ids`` in batches of ``batch_size``, and every block's other
        arguments per batch: ``(hidden per batch, calls[layer][batch])``. Needs :meth:`outer`."""
        hidden, calls, memo = [], [[] for _ in self.blocks], {}
        with _block_forwards(self.blocks, [self._recorder(i, calls, hidden, memo) for i in range(len(self.blocks))]):
            base = self.original.get_decoder() if hasattr(self.original, "get_decoder") else self.original
            for start in range(0, len(ids), batch_size):
                try:
                    base(input_ids=ids[start : start + batch_size].to(self.device), use_cache=False)
                except _Stop:
                    pass
        return hidden, calls

    def _recorder(self, index: int, calls, hidden, memo: dict):
        last = index == len(self.blocks) - 1

        def forward(*args, **kwargs):
            in_args = bool(args)
            x = args[0] if in_args else kwargs.pop("hidden_states")
            rest = args[1:] if in_args else ()
            kwargs = {
                k: _per_stream(v, memo)
                for k, v in kwargs.items()
                if k not in ("use_cache", *CACHE_NAMES, "past_key_value")
            }
            rest = tuple(None if a is not None and _is_cache(a) else _per_stream(a, memo) for a in rest)
            calls[index].append(BlockCall(rest, kwargs, in_args))
            if index == 0:
                hidden.append(x.detach().clone())
            elif index == 1:  # the first block returned its input: a tuple-reading model handed on its first row
                self._tuple_outputs = x.dim() < hidden[-1].dim()
            if last:
                raise _Stop
            return x

        return forward

    @torch.no_grad()
    def score(self, hidden: list, blocks: torch.Tensor, batch_size: int, original: list | None = None):
        """``(perplexity, top-1)`` of the last block's outputs ``hidden`` (per batch of ``batch_size`` rows of
        ``blocks``; the layout of :func:`hf_qknorm.data.perplexity`: every position but the last predicts the next);
        top-1 is the share of positions where the next token agrees with the one from ``original`` (``None``
        without it). Needs :meth:`outer`. Scoring several streams against the same ``original`` computes the
        original's logits once (:meth:`_reference_top1`): with a large vocabulary the output head is most of the cost.
        """
        nll, count, same = 0.0, 0, 0
        for j, h in enumerate(hidden):
            ids = blocks[j * batch_size : (j + 1) * batch_size].to(h.device)
            for row in range(len(ids)):  # one block at a time: the logits of a large vocabulary dominate memory
                logits = self.logits(rows(h, row))[0, :-1].float()
                nll += F.cross_entropy(logits, ids[row, 1:], reduction="sum").item()
                if original is not None:
                    top = logits.argmax(-1)
                    same += (top == self._reference_top1(original[j], row, top if original[j] is h else None)).sum()
                count += ids.shape[1] - 1
        return math.exp(nll / count), None if original is None else int(same) / count

    def _reference_top1(self, x: torch.Tensor, row: int, known: torch.Tensor | None = None) -> torch.Tensor:
        """The next-token choices (argmax of the logits) for row ``row`` of the reference hidden states ``x``,
        computed once per tensor while :meth:`outer` lasts (``known``: already computed by the caller). A tensor
        changed in place since (its version counter moved) is computed again."""
        key = (id(x), row)
        hit = self._top1.get(key)
        if hit is not None and hit[0] is x and hit[1] == x._version:
            return hit[2]
        top = known if known is not None else self.logits(rows(x, row))[0, :-1].float().argmax(-1)
        self._top1[key] = (x, x._version, top)
        return top

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's logits for the last block's output ``x`` ``(batch, seq, hidden)``: the rest of the model's own
        forward -- whatever it does after the blocks (final norm, an output projection, a logit scale or cap) --
        with the first block handing on ``x`` and the others passing it through (needs :meth:`outer`)."""
        forwards = [_replay(x)] + [_passthrough] * (len(self.blocks) - 1)
        if self._tuple_outputs:
            forwards = [lambda *a, _f=f, **k: (_f(*a, **k),) for f in forwards]
        with _block_forwards(self.blocks, forwards):
            ids = torch.zeros(x.shape[-3:-1], dtype=torch.long, device=x.device)
            return text_runner(self.original)(input_ids=ids, use_cache=False).logits


def rows(hidden: torch.Tensor, row: int, count: int = 1) -> torch.Tensor:
    """Rows ``row .. row + count`` of a block's hidden states ``(..., batch, seq, width)``: the batch is the third
    dimension from the end (Gemma 3n's blocks pass a stack of AltUp predictions in front of it)."""
    return hidden.narrow(-3, row, count)


@contextmanager
def _block_forwards(blocks, forwards):
    """Each block's ``forward`` replaced on the instance by the matching one of ``forwards`` for the ``with``, then
    each block's own instance ``forward`` (or none) restored, whatever happened."""
    originals = [blk.__dict__.get("forward") for blk in blocks]
    for blk, fwd in zip(blocks, forwards):
        blk.forward = fwd
    try:
        yield
    finally:
        for blk, fwd in zip(blocks, originals):
            if fwd is None:
                del blk.forward
            else:
                blk.forward = fwd


def _replay(x: torch.Tensor):
    def forward(*args, **kwargs):
        return x

    return forward


def _passthrough(*args, **kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _is_cache(value) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(value, Cache)


def run_capturing(block: nn.Module, module: nn.Module, inputs: list, calls: list, stream: str) -> tuple[list, list]:
    """``block`` on each of ``inputs`` with its recorded ``calls`` in stream ``stream``: ``(captured, outputs)``,
    where ``captured`` holds the outputs of ``module`` inside it (an attention layer's: the targets its converted
    twin is fitted to)."""
    captured = []
    hook = module.register_forward_hook(lambda m, a, o: captured.append((o[0] if isinstance(o, tuple) else o).detach()))
    try:
        out = run_blocks(block, inputs, calls, stream)
    finally:
        hook.remove()
    return captured, out


def run_blocks(block: nn.Module, inputs: list, calls: list, stream: str) -> list:
    """:func:`run_block` on each of ``inputs`` with the matching recorded call."""
    return [run_block(block, h, call, stream) for h, call in zip(inputs, calls)]


def run_block(block: nn.Module, hidden: torch.Tensor, call: BlockCall, stream: str) -> torch.Tensor:
    """``block`` on ``hidden`` with the arguments the model's forward gave it, as stream ``stream`` (module
    docstring: the copy of a shared mapping it reads and writes)."""
    call = call.bind(stream)
    if call.hidden_in_args:
        out = block(hidden, *call.args, **call.kwargs)
    else:
        out = block(hidden_states=hidden, **call.kwargs)
    return out[0] if isinstance(out, tuple) else out
