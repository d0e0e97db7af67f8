"""The model zoo (faithful parameter shapes, runs on real tensors) and the bundled chains."""
import glob
import json
import os

import pytest
import torch


from bench.chains import load, names
from bench.chains.make_chains import configs, make
from bench.models import build
from scheduler import Chain
from scheduler.profile import meta_chain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAINS = sorted(glob.glob(os.path.join(ROOT, "bench", "chains", "*.json")))


def n_params(model) -> int:
    return sum({id(p): p.numel() for b in model.blocks for p in b.parameters()}.values())


@pytest.mark.parametrize("name, params, blocks", [
    # torchvision's / Hugging Face's parameter counts for the same architectures
    ("resnet18", 11_689_512, 14), ("resnet50", 25_557_032, 22), ("resnet101", 44_549_160, 39),
    ("resnet152", 60_192_808, 56), ("densenet121", 7_978_856, 67), ("densenet201", 20_013_928, 107),
    ("gpt2", 124_439_808, 14),              # GPT-2 small, LM head tied to the token embedding
    ("bert", 109_482_240 + 768 * 2 + 2, 14),  # BertModel-base with pooler + a 2-way classifier
    ("resnet1001", None, 338),              # seed 002: "a chain of length 339" (with the loss)
])
def test_zoo_architectures(name, params, blocks):
    m = build(name, device="meta")
    assert len(m.blocks) == blocks
    if params is not None:
        assert n_params(m) == params
    assert all(p.device.type == "meta" for b in m.blocks for p in b.parameters())


@pytest.mark.parametrize("name, kwargs", [
    ("resnet18", dict(image=32)), ("densenet121", dict(image=32)),
    ("gpt2", dict(seq_len=8, n_layer=2, n_embd=32, n_head=4, vocab=50)),
    ("bert", dict(seq_len=8, n_layer=2, hidden=32, heads=4, intermediate=64, vocab=50)),
])
def test_zoo_models_run_on_real_tensors(name, kwargs):
    torch.manual_seed(0)
    m = build(name, batch=2, **kwargs)
    x = m.sample_input()
    assert tuple(x.shape) == m.input_shape and x.dtype == m.input_dtype
    for b in m.blocks:
        x = b(x)
    assert torch.isfinite(x).all()
    x.float().sum().backward()


def test_preact_bottlenecks_of_resnet1001_run_on_real_tensors():
    from bench.models.resnet import PreActBottleneck, _stage
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    for b in _stage(PreActBottleneck, 16, 8, 2, 2, preact=True):  # projection, then identity
        x = b(x)
    assert x.shape == (2, 32, 4, 4)
    x.sum().backward()


def test_bert_takes_any_sequence_length():
    m = build("bert", batch=2, seq_len=8, n_layer=1, hidden=16, heads=2, intermediate=32, vocab=20)
    for T in (3, 8, 17):
        x = m.sample_input(shape=(2, T))
        for b in m.blocks:
            x = b(x)
        assert x.shape == (2, 2)
    chains = [meta_chain(m.blocks, (2, T), input_dtype=torch.long) for T in (16, 32)]
    assert chains[1].x[1] == 2 * chains[0].x[1]          # activations linear in T
    assert chains[1].xbar[1] > 2 * chains[0].xbar[1]     # attention: quadratic part


def test_zoo_validation():
    with pytest.raises(ValueError, match="name"):
        build("vgg16")
    with pytest.raises(ValueError, match="depth"):
        from bench.models import resnet
        resnet(42)
    with pytest.raises(ValueError, match="batch"):
        build("resnet18", batch=0)
    with pytest.raises(ValueError, match="seq_len"):
        build("bert", seq_len=513)


def test_resnet1001_meta_chain_is_fast_and_consistent():
    m = build("resnet1001", batch=1, image=224, device="meta")
    c = meta_chain(m.blocks, m.input_shape)
    assert c.L == 338 and c.x[0] == 3 * 224 * 224 * 4
    assert all(c.xbar[s] >= c.x[s + 1] for s in range(c.L))
    assert all(t > 0 for t in c.fw) and c.total_compute() > 0


def test_every_bundled_chain_loads():
    expected = {stem for stem, _, _ in configs()}
    assert set(names()) == expected
    for path in CHAINS:
        c = Chain.from_json(path)
        stem = os.path.basename(path)[:-5]
        assert c.name == stem and c.is_integer and c.L >= 10
        m = c.meta
        if "image" in m:
            assert c.x[0] == m["batch"] * 3 * m["image"] ** 2 * 4
        else:
            assert c.x[0] == m["batch"] * m["seq_len"] * 8 and c.delta[0] == 0
        assert all(c.xbar[s] >= c.x[s + 1] for s in range(c.L))
        assert os.path.getsize(path) < 40_000


def test_bundled_chains_are_reproducible():
    stem = "resnet18-i224-b8"
    fresh = make(stem, "resnet18", {"batch": 8, "image": 224})
    stored = load(stem)
    # the numbers are the claim; meta names the torch that made the file
    fresh = fresh.replace(meta={**fresh.meta, "torch": stored.meta["torch"]})
    assert fresh == stored
    assert json.loads(json.dumps(fresh.to_dict())) == json.loads(open(os.path.join(ROOT, "bench", "chains", stem + ".json")).read())
