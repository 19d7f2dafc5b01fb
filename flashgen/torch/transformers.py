"""A one-line switch for Hugging Face transformers: ``attn_implementation="fg_attention"``.

    import flashgen.torch
    name = flashgen.torch.register_transformers()     # "fg_attention"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

(Not "flashgen": transformers 5 takes any implementation name containing "flash" for a
FlashAttention package and refuses to build the model without one.)

transformers calls a registered attention function with [B, H, S, D] query and
[B, Hk, S, D] key/value and wants [B, S, H, D] back: flashgen's kernels read the
first layout as strided views and write the second, so nothing is copied.  The mask
side is registered too (transformers' SDPA mask builder), so a batch without padding
gets no mask at all and runs on the causal kernels instead of a dense bias.
"""
from __future__ import annotations


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-interface signature; returns (output [B, S, H, D], no weights)."""
    import torch

    from flashgen.torch import attention

    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window")
    bias = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :key.shape[2]]
        if mask.dtype == torch.bool:  # True: take part
            bias = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        else:
            bias = mask.to(query.dtype)
        is_causal = False  # the mask holds the causal structure
    causal = "top_left" if is_causal and query.shape[2] > 1 else None
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), bias, causal=causal,
                    scale=scaling, dropout_p=dropout if module.training else 0.0,
                    window=None if window is None or not causal else (window - 1, None))
    return out, None


def register_transformers(name: str = "fg_attention") -> str:
    """Register flashgen's attention (and SDPA's mask builder) under ``name`` with transformers;
    returns the name to pass as ``attn_implementation``."""
    if "flash" in name:
        raise ValueError(f"transformers takes an attention implementation named {name!r} for a FlashAttention "
                         f"package (any name containing 'flash'); register flashgen under another name")
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError(f"register_transformers needs the transformers package with AttentionInterface "
                          f"(4.48 or later): {e}") from None
    AttentionInterface.register(name, _attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # an older transformers builds masks on its own
        return name
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
