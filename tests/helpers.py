"""Reference comparisons shared by the tests: greedy equality up to documented near-ties."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3


@torch.inference_mode()
def reference_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Logits of the Hugging Face reference for every position of `token_ids`."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def reference_greedy(hf_model, prompt: list[int], max_new_tokens: int, eos: list[int] | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def assert_greedy_match(hf_model, prompt: list[int], expected: list[int], got: list[int], label: str) -> bool:
    """Equal, or first divergence at a near-tie of the reference (printed). Returns True if equal.

    When the sequences diverge at a near-tie, the rest cannot be compared (they continue from
    different tokens), so only the shared prefix is checked.
    """
    if expected == got:
        return True
    n = min(len(expected), len(got))
    i = next((k for k in range(n) if expected[k] != got[k]), n)
    if i == n:
        raise AssertionError(f"{label}: lengths differ ({len(expected)} vs {len(got)}) with equal prefix")
    logits = reference_logits(hf_model, prompt + expected[:i])[-1]
    top2 = logits.topk(2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < NEAR_TIE, (
        f"{label}: diverged at step {i} (expected {expected[i]}, got {got[i]}) "
        f"and the reference's top-2 gap {gap:.2e} is not a near-tie"
    )
    print(f"NEAR-TIE {label}: step {i}, top-2 gap {gap:.2e}; expected {expected[i]} got {got[i]}")
    return False


QUANTIZED_TIE = 0.0625  # two of the 1/32-nat steps int8 kernels' logits come in on AVX2 CPUs


def assert_quantized_match(base, got: list[int], label: str, tie: float = QUANTIZED_TIE) -> bool:
    """A quantized engine against the same quantization split differently (TP, PP): equal, or
    the first divergence is a tie of the quantized model itself, judged on `base`'s own top
    logprobs (a CompletionOutput run with logprobs >= 2). The fp32 reference's gap says
    nothing here: int8 kernels round their outputs (on an AVX2 CPU logits come in steps of
    1/32 nat, and exact ties occur), and a partial sum rounded differently breaks such a tie
    the other way. Two different arithmetics (int8 activations against weight-only) pass the
    noise they measured between themselves as `tie`."""
    expected = base.token_ids
    if expected == got:
        return True
    n = min(len(expected), len(got))
    i = next((k for k in range(n) if expected[k] != got[k]), n)
    assert i < n, f"{label}: lengths differ ({len(expected)} vs {len(got)}) with equal prefix"
    top = sorted(base.logprobs[i].values())[-2:]
    gap = top[1] - top[0]
    assert gap <= tie, f"{label}: diverged at step {i} where the quantized model's top-2 gap is {gap:.3g}"
    print(f"QUANTIZED TIE {label}: step {i}, top-2 gap {gap:.3g}")
    return False


def agreed_logprob_noise(pairs) -> float:
    """How far two runs (CompletionOutput pairs, logprobs >= 1) put the same token's logprob
    apart while their tokens agree: the noise between two arithmetics. A flip of the top two
    needs their difference to move, which each run's error can do by up to twice this."""
    return max(
        abs(a.logprobs[k][tok] - b.logprobs[k][tok])
        for a, b in pairs
        for k, tok in enumerate(a.token_ids)
        if b.token_ids[: k + 1] == a.token_ids[: k + 1]
    )


def q8_0_like_table(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A float32 table as a GGUF Q8_0 one dequantizes: int8 codes x one fp16 scale per 32."""
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(rows, cols // 32, generator=g) * 0.02 + 1e-4).half().float()
    codes = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g).float()
    codes[..., 3] = 127  # llama.cpp's quantizer maps each group's largest value to +-127
    codes[0, 0] = 0  # an all-zero group (scale 0)
    return (codes * scales.unsqueeze(-1)).flatten(1)
