"""Moved to tests/support/oracle.py; kept for the modules still in this folder."""

from tests.support.oracle import chat_prompt_ids, expected_completion, tokenizer

__all__ = ["chat_prompt_ids", "expected_completion", "tokenizer"]
