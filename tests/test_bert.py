"""The BERT family against transformers' own BertForMaskedLM and BertForSequenceClassification
(built locally from a BertConfig with random weights; nothing downloaded), and in the layouts the
conformance suite does not run for every family (1d with sequence parallelism, D&SP-cSub with
two sub-grids, data parallelism): with the suite's serial equivalence in every mode's first
layout and the pipeline layouts, every layout then equals transformers.

A gradient's difference is relative to the tensor's largest entry, or to 1e-4 of the largest
gradient of the model where that is larger: the key bias's gradient is analytically zero (softmax
ignores a constant per query), so its value in either implementation is rounding noise.
"""

import pytest
import torch
from test_conformance import assert_layout_equals_serial

import lattice
from lattice.models import hf as lhf
from lattice.models.bert import Bert, BertConfig

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=61, seq_len=16, d_model=32, n_heads=4, n_layers=2, intermediate_size=40)


@torch.no_grad()
def random_hf_bert(num_labels: int, seed=0):
    """A float64 BERT of transformers in eval mode (no dropout), every parameter random (its init
    leaves norm weights at 1 and biases at 0, which would hide a mix-up of either)."""
    torch.manual_seed(seed)
    hf_config = Bert.hf.config_to_hf(BertConfig(**CFG, num_labels=num_labels))
    cls = transformers.BertForSequenceClassification if num_labels else transformers.BertForMaskedLM
    model = cls(hf_config).double().eval()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    return model


def _worst_grad(ours: dict, theirs: dict) -> float:
    floor = 1e-4 * max(float(g.abs().max()) for g in theirs.values())
    return max(float((ours[k] - g).abs().max()) / max(float(g.abs().max()), floor) for k, g in theirs.items())


@pytest.mark.fast
@pytest.mark.parametrize("num_labels", [0, 3])
def test_serial_bert_equals_transformers(num_labels):
    """Catches any difference from transformers' BERT in the forward or backward of either head:
    post- versus pre-LayerNorm, a missing token-type row or embedding LayerNorm, the tanh GELU
    for the exact one, a causal mask in the encoder, the MLM transform or output bias, -100
    targets counted in the mean, the pooler's tanh or the wrong pooled position, or a
    transposed / misnamed tensor in the HF mapping."""
    hf_model = random_hf_bert(num_labels)
    model = lattice.from_hf(hf_model, lattice.context("serial"))
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG["vocab_size"], (4, 12), generator=gen)
    if num_labels:
        targets = torch.randint(0, num_labels, (4,), generator=gen)
    else:
        targets = torch.randint(0, CFG["vocab_size"], (4, 12), generator=gen)
        targets[torch.rand(4, 12, generator=gen) > 0.3] = -100  # BERT labels only its masked positions
    reference = hf_model(input_ids=tokens, labels=targets).loss
    reference.backward()
    loss = model(tokens, targets)
    loss.backward()
    theirs = {name: p.grad for name, p in hf_model.named_parameters()}
    ours = lhf.to_hf_state_dict(Bert, model.cfg, model.full_grad_dict())
    assert set(theirs) <= set(ours)
    assert abs(loss.item() - reference.item()) / reference.item() < 1e-12
    assert _worst_grad(ours, theirs) < 1e-10
    with torch.no_grad():  # inference: the MLM logits over the vocabulary, or the class logits
        assert torch.allclose(model(tokens), hf_model(input_ids=tokens).logits, rtol=0, atol=1e-12)


def test_hf_export_names_the_class_of_the_head(tmp_path):
    """Catches a classifier exported as a masked LM (or the reverse): the directory's config names
    BertForSequenceClassification with its labels, and loading it back gives the same function."""
    hf_model = random_hf_bert(3)
    model = lattice.from_hf(hf_model, lattice.context("serial"))
    assert model.cfg.num_labels == 3
    lhf.write_hf_dir(Bert, model.cfg, model.full_state_dict(), tmp_path)
    back = lattice.models.load_hf_dir(tmp_path)
    assert type(back).__name__ == "BertForSequenceClassification" and back.config.num_labels == 3
    tokens = torch.randint(0, CFG["vocab_size"], (2, 10))
    with torch.no_grad():
        assert torch.equal(back.double()(input_ids=tokens).logits, hf_model(input_ids=tokens).logits)


@pytest.mark.parametrize("layout", [{"mode": "1d", "tp": 2, "sequence_parallel": True},
                                    {"mode": "subgraph", "tp": 2, "subgrids": 2, "common": "subgrid"},
                                    {"mode": "serial", "tp": 1, "dp": 2}],
                         ids=["1d-sp", "subgraph-csub", "dp2"])
def test_bert_layouts_beyond_the_suite_equal_serial(layout):
    """Catches a BERT piece that only breaks with a sequence-split residual (the replicated MLM
    dense's gradient sum, the pooled token on one rank), with D&SP-cSub's idle ranks (the
    output bias and the replicated heads), or across data-parallel replicas -- against serial,
    with the cost model's bytes and activations, as the conformance suite checks."""
    assert_layout_equals_serial("bert", layout)
