"""SmoothQuant for a language model's int8 variant: activation outliers moved into the weights.

A few channels of a language model's activations are far larger than the rest, so a per-row int8
scale (the row's largest value / 127) leaves the other channels a handful of levels. SmoothQuant
(Xiao et al., 2023) divides each input channel k of a matrix product by

    s_k = max|X_k| ** alpha / max|W_k| ** (1 - alpha)

and multiplies row k of the weight by it: X W = (X / s)(s W), the same product, with activations
that quantize better and weights that still do (per output column). Here every division lands
on a weight the float graph already multiplies by, so the smoothed model computes the same
function with no extra node:

* q/k/v and gate/up inputs are RMSNorm outputs: the norm's scale takes 1 / s (Gemma's norms
  scale by 1 + w: w becomes (1 + w) / s - 1);
* the down projection's input is silu(gate) * up: up's output rows take 1 / s;
* the output projection's input is attention over V: V's output rows (and bias) take 1 / s, one
  factor per key/value channel shared by the query heads of its group (grouped-query attention);
* the LM head's input is the final norm's output: the norm takes 1 / s, and the head gets its own
  (untied) weight, so the input embedding is unchanged.

`max|X_k|` comes from running the torch model on calibration prompts.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnserve.model.decoder_only import DecoderOnly, DecoderOnlyLayer, RMSNorm

ALPHA = 0.5
EPS = 1e-5


def activation_maxima(model: DecoderOnly, prompts: Sequence[Sequence[int]]) -> dict[str, Tensor]:
    """max |x| per input channel of every matrix product, over all tokens of `prompts`
    (keys: the module names of the products' inputs, e.g. "layers.0.self_attn.q_proj")."""
    maxima: dict[str, Tensor] = {}
    hooks = []

    def record(name: str) -> object:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            x = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0).float()
            maxima[name] = torch.maximum(maxima[name], x) if name in maxima else x

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_pre_hook(record(name)))  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([list(prompt)])
                model(ids, torch.ones_like(ids, dtype=torch.bool))
    finally:
        for h in hooks:
            h.remove()
    return maxima


def _factors(x_max: Tensor, weights: Sequence[Tensor], alpha: float) -> Tensor:
    """s_k for input channel k of the products with `weights` (out, in) that read one input."""
    w_max = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = x_max.clamp(min=EPS) ** alpha / w_max.clamp(min=EPS) ** (1 - alpha)
    return s.clamp(min=EPS)


def _divide_norm(norm: RMSNorm, s: Tensor) -> None:
    """The norm's output divided by s (per channel): its scale, 1 + w for Gemma's, over s."""
    if norm.unit_offset:
        norm.weight.copy_(norm.scale() / s - 1.0)
    else:
        norm.weight.div_(s)


def _scale_inputs(linears: Sequence[nn.Linear], s: Tensor) -> None:
    for linear in linears:
        linear.weight.mul_(s[None, :])


def smooth(
    model: DecoderOnly, maxima: dict[str, Tensor], alpha: float = ALPHA, *, in_place: bool = False
) -> DecoderOnly:
    """A smoothed copy of `model` (same function in exact arithmetic), `model` unchanged; with
    `in_place`, `model` itself smoothed (no second copy of the weights in memory)."""
    out = (model if in_place else copy.deepcopy(model)).eval()
    cfg = out.config
    groups = cfg.num_heads // cfg.num_kv_heads
    with torch.no_grad():
        for i, module in enumerate(out.layers):
            layer: DecoderOnlyLayer = module  # type: ignore[assignment]
            attn, mlp = layer.self_attn, layer.mlp
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            s = _factors(maxima[f"layers.{i}.self_attn.q_proj"], [m.weight for m in qkv], alpha)
            _divide_norm(layer.input_layernorm, s)
            _scale_inputs(qkv, s)

            gate_up = (mlp.gate_proj, mlp.up_proj)
            s = _factors(maxima[f"layers.{i}.mlp.gate_proj"], [m.weight for m in gate_up], alpha)
            _divide_norm(layer.mlp_norm, s)
            _scale_inputs(gate_up, s)

            s = _factors(maxima[f"layers.{i}.mlp.down_proj"], [mlp.down_proj.weight], alpha)
            mlp.up_proj.weight.div_(s[:, None])
            _scale_inputs([mlp.down_proj], s)

            # o_proj reads (query head, d) channels; query heads h*G..h*G+G-1 read V head h, so
            # a factor per (kv head, d), the largest of its group's activations and weights
            kv_shape = (cfg.num_kv_heads, groups, cfg.head_dim)
            x_max = maxima[f"layers.{i}.self_attn.o_proj"].reshape(kv_shape).amax(dim=1)
            w_max = attn.o_proj.weight.abs().amax(dim=0).reshape(kv_shape).amax(dim=1)
            s_kv = (x_max.clamp(min=EPS) ** alpha / w_max.clamp(min=EPS) ** (1 - alpha)).clamp(
                min=EPS
            )  # (Hkv, D)
            attn.v_proj.weight.div_(s_kv.reshape(-1)[:, None])
            if attn.v_proj.bias is not None:  # V's output channel, bias included
                attn.v_proj.bias.div_(s_kv.reshape(-1))
            s_query = s_kv[:, None, :].expand(kv_shape).reshape(-1)
            _scale_inputs([attn.o_proj], s_query)

        s = _factors(maxima["lm_head"], [out.lm_head.weight], alpha)
        _divide_norm(out.norm, s)
        out.lm_head.weight = nn.Parameter(out.lm_head.weight.detach().clone() * s[None, :])
    return out
