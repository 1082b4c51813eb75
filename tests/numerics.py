"""Helpers the equivalence tests share: a relative difference, a random token batch and the
comparison of metered communication with the cost model's."""

import math

import torch


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (0 for two zero tensors)."""
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def assert_comm_equal(measured: dict, modelled: dict, context=()) -> None:
    """Metered against modelled communication, each a {(phase, op, group size): (calls, elements)}:
    the same keys, the calls exactly, the elements to 1e-9 relative (the model sums float
    products). Key by key rather than pytest.approx, which refuses mappings of tuples."""
    assert set(measured) == set(modelled), (*context, "keys only one side has:", set(measured) ^ set(modelled))
    for key, (calls, elements) in measured.items():
        want_calls, want_elements = modelled[key]
        assert calls == want_calls and math.isclose(elements, want_elements, rel_tol=1e-9), \
            (*context, key, "measured", (calls, elements), "modelled", modelled[key])


def random_batch(n: int, t: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (n, t) int64 uniform over the vocabulary, from `seed` alone."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=gen), torch.randint(0, vocab, (n, t), generator=gen)


def rms_norm_at_input_precision(self, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm forward (Llama's and the families on its blocks), but computed at the
    input's precision when that is float64: transformers casts to float32 first, which alone puts
    a float64 reference ~1e-8 from any float64 computation."""
    xs = x if x.dtype == torch.float64 else x.float()
    return self.weight * (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


def against_transformers(hf, model, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(relative difference of the loss, worst relative difference of a gradient) of a lattice
    `model` imported from the transformers causal LM `hf` against hf's own forward and backward
    on tokens x and next-token targets y."""
    import torch.nn.functional as F

    from lattice.models import hf as lattice_hf

    reference = F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
    reference.backward()
    loss = model.forward_backward(x, y)
    grads = lattice_hf.to_hf_state_dict(model.family, model.cfg, model.full_grad_dict())
    missing = [name for name, _ in hf.named_parameters() if name not in grads]
    assert not missing, f"no lattice gradient for {missing}"
    worst = max(rel_diff(grads[name], p.grad) for name, p in hf.named_parameters())
    return abs(loss - reference.item()) / reference.item(), worst

