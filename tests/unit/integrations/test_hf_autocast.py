"""A Hugging Face model under bf16 autocast trains through dyncp's ring attention as through SDPA.

A tiny Llama in float32 under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (what the
Trainer's ``bf16=True`` sets up): its RoPE leaves queries and keys in float32 while values come
out of their projection in bfloat16, and ring attention takes them as torch's SDPA does, in the
autocast dtype. The packed micro-batch (four documents, CP 1, ``causal_lm_loss``) gives the
loss and gradients of the same model with ``attn_implementation="sdpa"`` run document by
document under the same autocast, within bf16 tolerance (stated in the test).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from contexts import whole_batch_context  # noqa: E402

from dyncp.integrations.hf import causal_lm_loss, register_ring_attention  # noqa: E402
from dyncp.testing.hf_models import tiny_causal_lm, tiny_config  # noqa: E402

VOCAB = 61
LENGTHS = (37, 5, 64, 20)
BF16 = torch.bfloat16


def documents() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]


def model(attn: str, seen: list[torch.dtype]) -> torch.nn.Module:
    """The float32 Llama; ``seen`` collects the dtype of every attention output (what each
    layer's output projection receives)."""
    m = tiny_causal_lm(tiny_config("llama", vocab=VOCAB), attn, dtype=torch.float32)
    for layer in m.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    return m


def ring_step(kernel: str) -> tuple[float, dict[str, torch.Tensor], list[torch.dtype]]:
    """The mean token loss of the packed micro-batch through ring attention, its gradients and
    the attention outputs' dtypes."""
    seen: list[torch.dtype] = []
    m = model(register_ring_attention(), seen)
    ctx = whole_batch_context(LENGTHS)
    with torch.autocast("cpu", dtype=BF16):
        loss = causal_lm_loss(m, ctx, torch.cat(documents()), kernel=kernel)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}, seen


def sdpa_step() -> tuple[float, dict[str, torch.Tensor], list[torch.dtype]]:
    """The same with torch's SDPA, one document per forward, under the same autocast."""
    seen: list[torch.dtype] = []
    m = model("sdpa", seen)
    total = sum(n - 1 for n in LENGTHS)
    with torch.autocast("cpu", dtype=BF16):
        loss = 0.0
        for ids in documents():
            logits = m(input_ids=ids[None], use_cache=False).logits[0].float()
            loss = loss + torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")
        loss = loss / total
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}, seen


@pytest.mark.parametrize("kernel", ["math", "sdpa"])
def test_bf16_autocast_matches_sdpa(kernel: str) -> None:
    loss, grads, dtypes = ring_step(kernel)
    ref_loss, ref_grads, ref_dtypes = sdpa_step()
    # Attention ran in the autocast dtype, as SDPA's did (not upcast to float32).
    assert set(dtypes) == set(ref_dtypes) == {BF16}
    # bf16 keeps 8 significant bits: one ulp is 2 ** -8 = 3.9e-3 relative, and the attention
    # outputs and the matmuls around them carry such roundings into loss and gradients, in a
    # different order on each side. Measured: loss 1.3e-5 relative (math kernel; 0 with the
    # sdpa kernel), gradients 7.1e-3 of each one's largest entry. Asserted: loss within 1e-3
    # relative, gradients within 2e-2 (5 ulps) of their largest entry.
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        assert err <= 2e-2 * ref.abs().max().item(), (name, err)
