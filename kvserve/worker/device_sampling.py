"""The runner's half of sampling on the device: the rows the engine listed in
`StepInput.device_sampling` are sampled where the logits are, so only their token ids cross to
the host (one int per row, not a [vocab] float32 row); every other row's logits are copied to
the host for the engine's sampler, as without device sampling.

The engine decides which rows qualify (executor/device_sampling.py); this side only trusts the
list, so a listed request that does not produce a token this step (a prefill chunk, a
speculative verification) simply keeps its usual path.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.model.layers.device_sampler import greedy_on_device, sample_on_device
from kvserve.worker.step_input import DeviceSampling, RunnerOutput


def _bitmask(spec: DeviceSampling, picks: list[int], words: int, device: torch.device) -> torch.Tensor | None:
    """[len(picks), words] int32 on the device: the engine's bitmask for constrained rows,
    all ones (everything allowed) for the others; None when no picked row is constrained."""
    where = {entry: i for i, entry in enumerate(spec.grammar_rows)}
    rows = [(j, where[p]) for j, p in enumerate(picks) if p in where]
    if not rows:
        return None
    words_in = np.frombuffer(bytearray(spec.bitmask), dtype=np.int32)  # writable: torch asks
    filled = torch.from_numpy(words_in).reshape(len(spec.grammar_rows), -1)
    mask = torch.full((len(picks), filled.shape[1]), -1, dtype=torch.int32)
    mask[[j for j, _ in rows]] = filled[[i for _, i in rows]]
    if mask.shape[1] < words:  # tokens past the grammar's vocabulary are never allowed
        mask = torch.nn.functional.pad(mask, (0, words - mask.shape[1]))
    return mask.to(device, non_blocking=True)


def sample_listed_rows(
    out: RunnerOutput, logits: torch.Tensor, spec: DeviceSampling, generator: torch.Generator
) -> None:
    """Fill `out.sampled` with the listed sample rows' tokens and `out.logits` (float32, host)
    with the remaining rows; `out.sample_req_ids` keeps only the remaining sample rows.

    logits: [rows, vocab] on the device, one row per out.sample_req_ids then the verify rows."""
    entry = {rid: i for i, rid in enumerate(spec.req_ids)}
    on_device = [i for i, rid in enumerate(out.sample_req_ids) if rid in entry]
    if not on_device:
        out.logits = logits.float().cpu()
        return
    picks = [entry[out.sample_req_ids[i]] for i in on_device]
    index = torch.tensor(on_device, device=logits.device)
    bitmask = _bitmask(spec, picks, -(-logits.shape[1] // 32), logits.device)
    temperature = [spec.temperature[p] for p in picks]
    if not any(temperature):  # all greedy (known here, no sync): no sort, no noise
        tokens = greedy_on_device(logits.index_select(0, index), bitmask)
    else:
        tokens = sample_on_device(
            logits.index_select(0, index),
            torch.tensor(temperature, device=logits.device),
            torch.tensor([spec.top_k[p] for p in picks], device=logits.device),
            torch.tensor([spec.top_p[p] for p in picks], device=logits.device),
            bitmask,
            generator,
        )  # fmt: skip
    chosen = set(on_device)
    host = [i for i in range(logits.shape[0]) if i not in chosen]
    if host:  # the rest, in order: host sample rows, then verify rows
        out.logits = logits.index_select(0, torch.tensor(host, device=logits.device)).float().cpu()
    out.sampled = dict(zip((out.sample_req_ids[i] for i in on_device), tokens.tolist()))
    out.sample_req_ids = [out.sample_req_ids[i] for i in host if i < len(out.sample_req_ids)]
