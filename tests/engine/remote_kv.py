"""Remote KV in engine tests: a prompt's KV copied from one engine's cache into another's, as a transfer would."""

from __future__ import annotations

from engine import LLMEngine


def copy_prompt_kv(src: LLMEngine, src_blocks, dst: LLMEngine, dst_blocks, num_tokens: int) -> None:
    """Token by token, as a disaggregated transfer would place it (source NHD; destination NHD or HND)."""
    sb, db = src.cache.block_size, dst.cache.block_size
    for p in range(num_tokens):
        value = src.cache.kv[:, :, src_blocks[p // sb], p % sb]  # [layers, 2, heads, dim]
        if dst.cache.order == "HND":
            dst.cache.kv[:, :, dst_blocks[p // db], :, p % db] = value
        else:
            dst.cache.kv[:, :, dst_blocks[p // db], p % db] = value
