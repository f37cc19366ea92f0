"""Attention as the target device runs it, for analytic profiles, and which attention a model runs.

On the meta device `scaled_dot_product_attention` takes the math path: the S x S scores and
probabilities are made and saved for backward, as eager attention does. GPUs run a memory-efficient
kernel (FlashAttention, or PyTorch's efficient-attention kernel) instead. `use_memory_efficient`
replaces every `scaled_dot_product_attention` call of a captured graph by `memory_efficient_attention`,
whose costs are those of such a kernel, for q of shape (B, H, Sq, D) and k, v of (B, H_kv, Sk, D):

    forward   FLOPs 4 B H Sq Sk D (Q K^T and P V), reads q, k, v, writes out and the log-sum-exp
    backward  FLOPs 10 B H Sq Sk D: the kernel recomputes Q K^T and P, then dV, dP, dQ and dK
              (five matmuls, 2.5 x the forward's two); reads q, k, v, out, dout, log-sum-exp,
              writes dq, dk, dv
    saved     q, k, v, out and the log-sum-exp (B H Sq fp32): O(S) per head, no S x S tensor

Causal attention skips the blocks above the diagonal: the FLOPs are halved when the call is causal
(`is_causal`, or a square Sq x Sk mask, which decoder LMs pass as their causal mask under export; an
encoder's square padding mask is taken as causal too, crediting it half its attention FLOPs). A mask
is read (its bytes counted) but no S x S tensor is made or saved.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx

from planner.profile.analytic import charge

ATTENTION_CHOICES = ("flash", "as-built")  # analytic: the memory-efficient kernel, or what the model's code runs
_SDPA_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default,
                 torch.ops.aten.scaled_dot_product_attention)


def attention_of(module: torch.nn.Module) -> str:
    """The attention implementation a model runs: a Hugging Face config's `attn_implementation`
    (eager, sdpa, flash_attention_2, ...), else "model" (whatever its own code does)."""
    config = getattr(module, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "model")


def _matmul_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float:
    batch, heads, sq, d = q.shape[0], q.shape[-3], q.shape[-2], q.shape[-1]
    flops = 2.0 * batch * heads * sq * k.shape[-2] * (d + v.shape[-1])  # Q K^T and P V
    return flops / 2 if causal else flops


def _nbytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class _MemoryEfficientAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal: bool):
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        charge(_matmul_flops(q, k, v, causal), _nbytes(q, k, v, mask, out, lse), q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.mask_bytes = causal, _nbytes(mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
        charge(2.5 * _matmul_flops(q, k, v, ctx.causal),
               _nbytes(q, k, v, out, grad, lse, dq, dk, dv) + ctx.mask_bytes, q.dtype)
        return dq, dk, dv, None, None


def memory_efficient_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                               scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention's result shape, costed as a memory-efficient kernel (module docstring)."""
    square = attn_mask is not None and attn_mask.shape[-1] == attn_mask.shape[-2] == query.shape[-2] > 1
    mask = attn_mask if isinstance(attn_mask, torch.Tensor) else None
    return _MemoryEfficientAttention.apply(query, key, value, mask, bool(is_causal or square))


def use_memory_efficient(graph: fx.Graph) -> int:
    """Point every scaled_dot_product_attention call of `graph` at memory_efficient_attention; how many."""
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _SDPA_TARGETS:
            node.target = memory_efficient_attention
            count += 1
    return count

