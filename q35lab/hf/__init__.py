"""How q35lab meets transformers' Qwen3.5: which releases it supports, and what differs between
them (``versions``)."""
