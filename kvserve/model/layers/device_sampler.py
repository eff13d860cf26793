"""Sampling where the logits are: greedy, temperature, top-k, top-p and grammar bitmasks as
tensor ops on the logits' device, so a GPU step sends the host one token id per row instead of
a [rows, vocab] float32 copy (150k-token vocabularies make that copy ~600 KB a row).

Every operation is batched and free of host synchronisation (no .item(), no data-dependent
shapes): rows with temperature 0 take the argmax; the others are scaled, truncated (top-k, then
top-p over what is left) and drawn with the exponential race (argmax p / E, E ~ Exp(1)), as
sampler.py draws. A grammar bitmask is xgrammar's: int32 words, bit j of word w allowing token
32 w + j; it is unpacked on the device. Seeds, penalties, min-p and logprobs stay with the
engine's sampler (sampler.py), which needs the requests' history; the runner uses this one
only for rows that ask for none of them.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 -> [rows, vocab] bool, True where the token is allowed."""
    tokens = torch.arange(vocab_size, device=bitmask.device)
    words = bitmask.index_select(1, tokens // 32)
    return ((words >> (tokens % 32).to(torch.int32)) & 1).bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where the bitmask forbids a token (in place); returns logits."""
    return logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k (<= 0: all) most likely tokens, then the smallest set whose
    probability reaches top_p (1.0: all); the rest -> -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, logits.shape[1]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # probability of the tokens ranked above
    sorted_logits = sorted_logits.masked_fill(before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def greedy_on_device(logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """sample_on_device when every row is greedy (the caller knows from the requests' params):
    the argmax of each row after its bitmask, without the sort and noise of a draw."""
    logits = logits.float()
    if bitmask is not None:
        logits = apply_bitmask(logits.clone(), bitmask)
    return logits.argmax(-1)


def sample_on_device(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token ids [rows] (int64, on the logits' device) for logits [rows, vocab].

    temperature [rows] float (0: greedy), top_k [rows] int (<= 0: off), top_p [rows] float
    (1.0: off), bitmask [rows, ceil(vocab / 32)] int32 or None."""
    logits = logits.float()
    if bitmask is not None:
        logits = apply_bitmask(logits.clone(), bitmask)
    greedy = logits.argmax(-1)
    temp = temperature.float().clamp(min=1e-5).unsqueeze(1)
    probs = _truncate(logits / temp, top_k, top_p.float()).softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    drawn = (probs / noise).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)
