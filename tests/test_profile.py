"""scheduler.profile: meta_chain's exact sizes and cost-model times on hand-checked models,
agreement with measure_chain on real CPU tensors, tuples between blocks, and input validation."""
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Chain
from scheduler.profile import CostModel, measure_chain, meta_chain

from _live_bytes import LiveStorageBytes


SIZE_FIELDS = ("x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")


class SinBlock(nn.Module):
    """y = sin(2x): sin saves its input, the intermediate 2x (not the block's input)."""

    def forward(self, x):
        return (x * 2).sin()


class Split(nn.Module):
    def forward(self, x):
        return x.sin(), x.cos()


class Join(nn.Module):
    def forward(self, a, b):
        return a * b


def tiny():
    return [nn.Linear(4, 3, bias=False), nn.ReLU(), SinBlock(), nn.Linear(3, 5)]


def test_meta_chain_exact_sizes_on_a_hand_checked_model():
    # input (2, 4) float32 = 32 bytes; hidden (2, 3) = 24 bytes; output (2, 5) = 40 bytes.
    c = meta_chain(tiny(), (2, 4), loss="sum")
    assert c.L == 4
    assert c.x == (32, 24, 24, 24, 40)
    # Linear: saves its input (excluded: it is x[s]) and W^T (a parameter): only the output.
    # ReLU saves its output. SinBlock keeps 2x (24) and its output. The loss keeps its scalar.
    assert c.xbar == (24, 24, 48, 40, 4)
    assert c.delta == c.x
    # SinBlock's no-grad forward holds 2x while sin runs (24); its saving forward keeps 2x
    # (in xbar): no transient. bw_tmp is what B s holds beyond xbar[s], its input,
    # delta[s+1] and delta[s], less the stage's output (in xbar, but nothing holds it in
    # B s when the stage did not save it). The Linears' parameter gradients are transient
    # (added into .grad and freed): W 3x4 (48), then W 5x3 and the bias (60 + 20), less
    # the outputs (24, 40). SinBlock's backward holds cos(2x) and the gradient w.r.t. 2x
    # together (48): its output and delta[2] (24 + 24).
    assert c.fw_tmp == (0, 0, 0, 0, 0)
    assert c.fck_tmp == (0, 0, 24, 0, 0)
    assert c.bw_tmp == (24, 0, 0, 40, 0)
    assert c.is_integer


def test_meta_chain_times_are_flops_plus_bytes_over_the_cost_model():
    # with 1 FLOP/s and 1 byte/s, times are FLOPs + bytes moved, counted by hand:
    c = meta_chain(tiny(), (2, 4), loss="sum", flops_per_s=1, bytes_per_s=1)
    # Linear(4,3): mm 2*2*4*3 = 48 FLOPs; reads 32 + 48 (W^T), writes 24.
    # ReLU: 24 in + 24 out. SinBlock: mul 24+24, sin 24+24. Linear(3,5): addmm 60 FLOPs,
    # bias 20 + in 24 + W^T 60 + out 40. Loss: sum reads 40, writes 4.
    assert c.fw == (152.0, 48.0, 96.0, 204.0, 44.0)
    # backward: two mms per Linear (+ a bias sum), threshold_backward, cos/mul/mul; the loss's
    # backward is an expand (a view, free).
    assert c.bw == (304.0, 72.0, 168.0, 428.0, 0.0)
    half = meta_chain(tiny(), (2, 4), loss="sum", flops_per_s=2, bytes_per_s=2)
    assert half.fw == tuple(t / 2 for t in c.fw)


def test_default_cost_model_is_a_v100():
    c = meta_chain(tiny(), (2, 4), loss="sum")
    assert c.meta["flops_per_s"] == 14e12 and c.meta["bytes_per_s"] == 900e9
    assert math.isclose(c.fw[0], 48 / 14e12 + 104 / 900e9)
    assert CostModel().seconds(14e12, 900e9) == 2.0


def test_cross_entropy_loss_stage_keeps_log_probabilities():
    c = meta_chain([nn.Linear(4, 10)], (8, 4))  # default loss: cross entropy over the last dim
    assert c.x[1] == 8 * 10 * 4
    # log_softmax output and int64 targets and total_weight (saved by nll_loss) + the loss
    assert c.xbar[1] == 8 * 10 * 4 + 8 * 8 + 4 + 4
    assert c.delta[1] == c.x[1]


def test_tuples_between_blocks_sum_their_sizes():
    c = meta_chain([Split(), Join()], (2, 4), loss="sum")
    assert c.x == (32, 64, 32)
    assert c.delta == (32, 64, 32)
    assert c.xbar[0] == 64  # sin and cos save the block input (excluded); two outputs
    assert c.xbar[1] == 32  # mul saves both inputs (excluded); the output


def test_integer_input_has_no_gradient_and_input_grad_false():
    emb = nn.Embedding(10, 4)
    c = meta_chain([emb], (2, 3), input_dtype=torch.long, loss="sum")
    assert c.x[0] == 2 * 3 * 8 and c.delta[0] == 0
    c = meta_chain(tiny(), (2, 4), loss="sum", input_grad=False)
    assert c.delta[0] == 0 and c.delta[1:] == meta_chain(tiny(), (2, 4), loss="sum").delta[1:]


def test_cuda_like_dropout_counts_a_bool_mask():
    drop = [nn.Dropout(0.5)]
    cuda = meta_chain(drop, (4, 8), loss="sum")
    cpu = meta_chain(drop, (4, 8), loss="sum", cuda_dropout=False)
    out = 4 * 8 * 4
    assert cuda.xbar[0] == out + 4 * 8       # output + bool mask
    assert cpu.xbar[0] == out + 4 * 8 * 4    # output + float mask (the CPU kernel)


def test_meta_chain_leaves_real_weights_alone_and_is_deterministic():
    blocks = tiny()
    before = [p.detach().clone() for b in blocks for p in b.parameters()]
    a = meta_chain(blocks, (2, 4))
    b = meta_chain(blocks, (2, 4))
    assert a == b
    assert all(torch.equal(p, q) for p, q in zip(before, (p for b in blocks for p in b.parameters())))
    assert all(p.device.type == "cpu" for b in blocks for p in b.parameters())


def small_cnn():
    torch.manual_seed(0)
    return [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True)),
            nn.Flatten(), nn.Linear(8 * 8 * 8, 10)]


def test_measure_chain_sizes_agree_with_meta_chain_on_cpu():
    blocks = small_cnn()
    x = torch.randn(4, 3, 8, 8)
    meta = meta_chain(blocks, tuple(x.shape), cuda_dropout=False)
    real = measure_chain(blocks, x, repeat=2, warmup=0)
    for f in SIZE_FIELDS:
        assert getattr(real, f) == getattr(meta, f), f
    assert len(real.fw) == len(blocks) + 1
    assert all(t > 0 for t in real.fw[:-1]) and all(t >= 0 for t in real.bw)
    assert real.meta["device"] == "cpu" and real.meta["tmp"] == "op-tracer estimate"
    Chain.from_json(real.to_json())  # a valid chain


def test_measure_chain_sizes_agree_on_a_small_transformer():
    from bench.models import gpt2
    m = gpt2(batch=2, seq_len=16, n_layer=2, n_embd=32, n_head=4, vocab=100)
    meta = meta_chain(m.blocks, m.input_shape, input_dtype=m.input_dtype, cuda_dropout=False)
    real = measure_chain(m.blocks, m.sample_input(), repeat=1, warmup=0)
    for f in SIZE_FIELDS:
        assert getattr(real, f) == getattr(meta, f), f


class _SavesBig(torch.autograd.Function):
    """Saves a tensor 4x its input; its backward optionally allocates a 4x transient."""

    @staticmethod
    def forward(ctx, x, transient):
        big = x.repeat(4, 1)
        ctx.save_for_backward(big)
        ctx.transient = transient
        return x * 1

    @staticmethod
    def backward(ctx, g):
        (big,) = ctx.saved_tensors
        if ctx.transient:
            tmp = g.repeat(4, 1) * big  # a 4x transient, born while `big` is still saved
            return tmp[: g.shape[0]] + 0, None
        return g * big[: g.shape[0]], None


class _TwoSaves(nn.Module):
    def forward(self, x):
        return _SavesBig.apply(_SavesBig.apply(x, True), False)


def test_backward_transients_credit_saved_tensors_already_released():
    # the backward runs the outer node first, which reads its saved 4N, then autograd frees it
    # (no retain_graph); the inner node's transients (4N + 4N, while its own saved 4N is still
    # held) reuse that room. Counting the released 4N as still held (the old estimate: 8N
    # beyond xbar) overstated every real block's backward (HF GPT-2: 10 MiB instead of 3.5).
    # bw_tmp is beyond xbar (which holds the output, N: nothing holds it in B), the input,
    # delta[1] (N, freed once the outer node has read it) and delta[0] (N, made last): the
    # inner node holds its incoming gradient (N) and its transients (4N + 4N) until it returns
    # (the estimate frees the repeat's 4N at the node's end too: in truth 2N, counted 3N)
    x = torch.randn(64, 256)
    n = x.numel() * 4
    c = measure_chain([_TwoSaves()], x, loss="sum", repeat=1, warmup=0)
    assert c.xbar[0] >= 8 * n
    assert c.bw_tmp[0] == 3 * n, c.bw_tmp[0] / n


def test_measure_chain_leaves_buffers_rng_and_grads_untouched():
    blocks = small_cnn()
    state = [{k: v.clone() for k, v in b.state_dict().items()} for b in blocks]
    torch.manual_seed(123)
    measure_chain(blocks, torch.randn(2, 3, 8, 8), repeat=1, warmup=0)
    after_measure = torch.rand(3)
    torch.manual_seed(123)
    torch.randn(2, 3, 8, 8)
    assert torch.equal(torch.rand(3), after_measure)
    for b, sd in zip(blocks, state):
        for k, v in b.state_dict().items():
            assert torch.equal(v, sd[k]), k
    assert all(p.grad is None for b in blocks for p in b.parameters())


def test_measure_chain_tuples_between_blocks():
    c = measure_chain([Split(), Join()], torch.randn(2, 4), loss="sum", repeat=1)
    assert c.x == (32, 64, 32) and c.xbar[:2] == (64, 32)


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 5), widths=st.lists(st.integers(1, 9), min_size=2, max_size=5))
def test_mlp_sizes_follow_the_shapes(batch, widths):
    blocks = []
    for a, b in zip(widths, widths[1:]):
        blocks += [nn.Linear(a, b), nn.Tanh()]
    c = meta_chain(blocks, (batch, widths[0]), loss="sum")
    act = [batch * w * 4 for w in widths]
    assert c.x[0] == act[0]
    for i in range(len(widths) - 1):
        assert c.x[2 * i + 1] == c.x[2 * i + 2] == act[i + 1]
        assert c.xbar[2 * i] == act[i + 1]      # Linear keeps only its output
        assert c.xbar[2 * i + 1] == act[i + 1]  # Tanh keeps its output (= what it returns)
    assert c.delta == c.x
    assert all(c.xbar[s] >= c.x[s + 1] for s in range(c.L))


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("blocks, exc, match", [
    ([], ValueError, "model_blocks: empty"),
    ([nn.ReLU(), "relu"], TypeError, r"model_blocks\[1\]"),
    (nn.Linear(2, 2), TypeError, "single Linear"),
    (42, TypeError, "model_blocks"),
])
def test_bad_blocks_are_rejected(blocks, exc, match):
    with pytest.raises(exc, match=match):
        meta_chain(blocks, (2, 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_shape=(2, -1)), "input_shape"),
    (dict(input_shape="2x4"), "input_shape"),
    (dict(input_shape=(2, 4.0)), "input_shape"),
    (dict(input_shape=(2, 4), input_dtype="float32"), "input_dtype"),
    (dict(input_shape=(2, 4), loss="hinge"), "loss"),
    (dict(input_shape=(2, 4), flops_per_s=0), "flops_per_s"),
    (dict(input_shape=(2, 4), bytes_per_s=float("nan")), "bytes_per_s"),
])
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        meta_chain([nn.Linear(4, 4)], **kwargs)


def test_bad_block_outputs_and_in_place_blocks_are_rejected():
    class Dict(nn.Module):
        def forward(self, x):
            return {"y": x}
    with pytest.raises(TypeError, match=r"model_blocks\[1\].*tensor or a non-empty tuple"):
        meta_chain([nn.ReLU(), Dict()], (2, 2), loss="sum")
    with pytest.raises(RuntimeError, match=r"model_blocks\[0\] modifies its input in place"):
        meta_chain([nn.ReLU(inplace=True)], (2, 2), loss="sum")
    with pytest.raises(ValueError, match="cross_entropy"):
        meta_chain([Split()], (2, 2))  # two outputs: cross entropy does not apply


def test_measure_chain_validation():
    with pytest.raises(TypeError, match="sample_input"):
        measure_chain([nn.ReLU()], [1, 2])
    with pytest.raises(ValueError, match="repeat"):
        measure_chain([nn.ReLU()], torch.randn(2), repeat=0)
    with pytest.raises(ValueError, match="warmup"):
        measure_chain([nn.ReLU()], torch.randn(2), warmup=-1)
    with torch.device("meta"):
        lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"model_blocks\[0\]: weight is on meta"):
        measure_chain([lin], torch.randn(3, 2))


@pytest.mark.gpu
def test_measure_chain_on_cuda_agrees_with_meta_chain():
    blocks = [b.cuda() for b in small_cnn()]
    x = torch.randn(4, 3, 8, 8, device="cuda")
    real = measure_chain(blocks, x, repeat=3)
    meta = meta_chain(blocks, tuple(x.shape))
    for f in ("x", "xbar", "delta"):
        assert getattr(real, f) == getattr(meta, f), (f, getattr(real, f), getattr(meta, f))
    assert real.meta["tmp"] == "cuda allocator statistics", real.meta
    assert all(t > 0 for t in real.fw[:-1]), real.fw


def test_measuring_leaves_no_tracer_or_graph_behind():
    """The backward tracer's node hooks once held it (and every tensor it traced) in a cycle
    through the graph's C++ nodes that Python's collector cannot free: a leak per stage."""
    import gc
    from scheduler.profile import _trace
    measure_chain(tiny(), torch.randn(2, 4), loss="sum", repeat=1, warmup=0)
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, _trace.OpTracer)]


def test_cuda_transients_do_not_run_an_optimizer_stepping_in_the_backward(monkeypatch):
    # the CUDA measurement of a stage's backward (``_cuda_tmp``, run here on the CPU with the
    # allocator statistics stubbed) must not fire post-accumulate-grad hooks: an optimizer
    # stepping in the backward would step the weights on the measurement's random gradient
    from scheduler.profile import _trace as T
    from scheduler.profile import measure as M
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    fired = []
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    for p in block.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p.shape))
    x = torch.randn(4, 8, requires_grad=True)
    params = list(block.parameters())
    before = [p.detach().clone() for p in params]
    keys = {T.storage_key(p) for p in params}
    with T.hooks_silenced(block):  # as its callers measure (measure_chain, Mimose's collector)
        outs, got = M._cuda_stage(lambda xs: (block(*xs),), (x,), params, keys,
                                  torch.device("cpu"))
    assert fired == []
    assert all(p.grad is None for p in params) and x.grad is None
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    # the sizes are the op tracer's (the CPU path's); the transients come from the stubs
    _, traced = T.trace_stage(lambda xs: (block(*xs),), (x,), params, keys, cuda_dropout=False,
                              flops=False)
    assert (got["xbar"], got["dead_output"]) == (traced["xbar"], traced["dead_output"])
    assert torch.equal(outs[0], block(x)) and not outs[0].requires_grad
    assert min(got[k] for k in ("fw_tmp", "fck_tmp", "bw_tmp")) >= 0


def test_cuda_measurement_agrees_with_the_op_tracer(monkeypatch):
    """The CUDA path's transients (``_cuda_stage``, the allocator statistics stubbed by a
    counter of live storages) equal the op tracer's, stage by stage: in particular delta[s+1]
    is let go once its last reader ran, as in a real step, where it once was held through the
    whole measured backward (small_cnn's residual block: 10528 B for 2336 B)."""
    from scheduler.profile import _trace as T
    from scheduler.profile import measure as M
    from scheduler.profile.storage import keys_held
    counter = LiveStorageBytes()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: setattr(counter, "peak", counter.live))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counter.live)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counter.peak)
    torch.manual_seed(0)
    values, cpu = (torch.randn(4, 3, 8, 8),), torch.device("cpu")
    for s, block in enumerate(small_cnn()):
        inputs = T.fresh_inputs(values, requires_grad=True)
        params = list(block.parameters())

        def fn(xs, block=block, s=s):
            return T.call_block(block, xs, s)
        with M._preserved(block, cpu), keys_held(params + list(block.buffers())) as keys:
            with counter:
                values, got = M._cuda_stage(fn, inputs, params, keys, cpu)
            _, traced = T.trace_stage(fn, inputs, params, keys, cuda_dropout=False, flops=False)
        for k in ("xbar", "dead_output", "fw_tmp", "fck_tmp", "bw_tmp"):
            assert got[k] == traced[k], (s, k, got[k], traced[k])
