"""scheduler.checkpoint on real model code: Hugging Face GPT-2, BERT, Llama and T5 from small
configs (random weights, dropout on) and a non-sequential CNN. Every planner at three budgets:
losses and gradients bit-identical (torch.equal) to plain training, activation bytes held
within the plan's prediction; torch.autograd.grad, gradient accumulation, the HF Trainer."""
from __future__ import annotations

import copy
import functools
import inspect
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch import nn

import scheduler
from scheduler import InfeasibleError, simulate
from scheduler.planners import rotor
from scheduler.planners.mimose import plan_from_checkpoints
from scheduler.runtime.checkpoint import checkpointed, undo

from wrap_models import one_thread  # noqa: F401  (autouse fixture)

import transformers  # a test dependency (pyproject [test]): never skip silently
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*(use_cache|is_gradient_checkpointing).*")

FAST = {"repeat": 1, "warmup": 0}


def fast(planner: Any) -> Dict[str, Any]:
    """measure_options=FAST for the planners that measure a chain (Mimose and a Plan measure
    none, and the runtime refuses an option it would not read)."""
    return {} if planner == "mimose" or not isinstance(planner, str) else \
        {"measure_options": FAST}
VOCAB = 64


# ------------------------------------------------------------------------------ models
def gpt2() -> Tuple[nn.Module, Dict[str, Any]]:
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB,
                                  n_positions=32, bos_token_id=0, eos_token_id=0, use_cache=False)
    ids = torch.randint(0, VOCAB, (2, 12))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def bert() -> Tuple[nn.Module, Dict[str, Any]]:
    cfg = transformers.BertConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                  intermediate_size=64, vocab_size=VOCAB,
                                  max_position_embeddings=32)
    ids = torch.randint(1, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding: the mask really matters
    return transformers.BertForMaskedLM(cfg), {"input_ids": ids, "attention_mask": mask,
                                               "labels": ids}


def llama() -> Tuple[nn.Module, Dict[str, Any]]:
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                   max_position_embeddings=32, attention_dropout=0.1,
                                   use_cache=False, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    ids = torch.randint(0, VOCAB, (2, 12))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def t5() -> Tuple[nn.Module, Dict[str, Any]]:
    cfg = transformers.T5Config(num_layers=3, num_decoder_layers=3, d_model=32, d_kv=8,
                                d_ff=64, num_heads=4, vocab_size=VOCAB, dropout_rate=0.1,
                                use_cache=False, decoder_start_token_id=0, pad_token_id=0,
                                eos_token_id=1)
    ids = torch.randint(2, VOCAB, (2, 10))
    labels = torch.randint(2, VOCAB, (2, 7))
    return transformers.T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": labels}


MODELS: Dict[str, Callable[[], Tuple[nn.Module, Dict[str, Any]]]] = {
    "gpt2": gpt2, "bert": bert, "llama": llama, "t5": t5}
LISTS = {"gpt2": ["transformer.h"], "bert": ["bert.encoder.layer"], "llama": ["model.layers"],
         "t5": ["encoder.block", "decoder.block"]}


def make(name: str, seed: int = 0) -> Tuple[nn.Module, Dict[str, Any]]:
    torch.manual_seed(seed)
    model, batch = MODELS[name]()
    model.train()
    return model, batch


# ------------------------------------------------------------------------------ helpers
def step(model: nn.Module, batch: Dict[str, Any], seed: int) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def assert_same(ref: nn.Module, model: nn.Module, lr: torch.Tensor, lm: torch.Tensor,
                what: str) -> None:
    assert torch.equal(lr, lm), f"{what}: loss {lr.item()} != {lm.item()}"
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {n} grad presence"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{what}: {n} grad differs"


def runners(model: nn.Module):
    return checkpointed(model).runners


def chains_of(name: str) -> Tuple[List[Any], int]:
    """The measured chains (one per block list), via scheduler.checkpoint's profiling step."""
    model, batch = make(name)
    scheduler.checkpoint(model, budget=1 << 40, planner="rotor", measure_options=FAST)
    step(model, batch, 0)  # profiling step: the chain is measured on the blocks' real calls
    step(model, batch, 1)  # planned
    rs = runners(model)
    return [r.last_plan.chain for r in rs], sum(r.L for r in rs)


@functools.lru_cache(maxsize=None)
def budgets(name: str) -> List[int]:
    """Three total budgets: just above rotor's smallest, half way, and everything saved."""
    chains, n_all = chains_of(name)
    lists = [c.L for c in chains]
    lo = [rotor.min_memory(c) for c in chains]
    hi = [simulate(c, plan_from_checkpoints(c.L, [])).peak_memory for c in chains]
    out = []
    for f in (0.05, 0.5, 1.0):
        # the budget is shared by block count: the total that gives every list its share
        out.append(int(max((lo_i + f * (hi_i - lo_i)) * n_all / L_i
                           for lo_i, hi_i, L_i in zip(lo, hi, lists))) + 1)
    return out


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", sorted(MODELS))
def test_blocks_found(name):
    model, _ = make(name)
    found = scheduler.runtime.checkpoint.find_blocks(model)
    assert [n for n, _ in found] == LISTS[name]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_planner_three_budgets_bit_identical(name):
    ref, batch = make(name)
    all_budgets = budgets(name)
    recomputed_low = 0
    for planner in ("rotor", "pofo", "periodic", "mimose"):
        for k, budget in enumerate(all_budgets):
            model = copy.deepcopy(ref)
            scheduler.checkpoint(model, budget, planner, track_memory=True, **fast(planner))
            what = f"{name} {planner} budget={budget}"
            try:
                for seed in range(3):  # profiling/collection step, then the plan twice
                    lr = step(ref, batch, seed)
                    lm = step(model, batch, seed)
                    assert_same(ref, model, lr, lm, f"{what} step {seed}")
            except InfeasibleError:
                # periodic (and mimose's estimate) may not reach rotor's smallest budget
                assert planner in ("periodic", "mimose") and k == 0, what
                continue
            for r in runners(model):
                plan = r.last_plan
                assert plan.planner not in ("profile", "mimose-collect"), what
                held = r.stats()["last_peak_bytes"]
                assert 0 < held <= plan.predicted_peak, f"{what}: held {held} > {plan}"
                if k == 0:
                    recomputed_low += r.last_stats.recomputed_forwards
    assert recomputed_low > 0  # the smallest budget really recomputes


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_autograd_grad_and_accumulation(name):
    ref, batch = make(name)
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, budgets(name)[0], "rotor", measure_options=FAST)
    for seed in range(2):  # profiling step, then the plan
        params_r = [p for p in ref.parameters()]
        params_m = [p for p in model.parameters()]
        torch.manual_seed(seed)
        gr = torch.autograd.grad(ref(**batch).loss, params_r, allow_unused=True)
        torch.manual_seed(seed)
        gm = torch.autograd.grad(model(**batch).loss, params_m, allow_unused=True)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(gr, gm))
        assert all(p.grad is None for p in params_m)  # autograd.grad leaves .grad alone
    # gradient accumulation: two micro-batches, one optimizer step
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.1)
    for m, opt in ((ref, opt_r), (model, opt_m)):
        opt.zero_grad()
        for seed in (5, 6):
            torch.manual_seed(seed)
            (m(**batch).loss / 2).backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters())
               if p.grad is not None)


def test_eval_no_grad_autocast_and_frozen():
    ref, batch = make("llama")
    model = copy.deepcopy(ref)
    # half way: bf16 autocast keeps more (float32 and bf16 copies) than float32 alone
    scheduler.checkpoint(model, budgets("llama")[1], "rotor", measure_options=FAST)
    with torch.no_grad():
        ref.eval(), model.eval()
        assert torch.equal(ref(**batch).logits, model(**batch).logits)
        ref.train(), model.train()
    for seed in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lr = step(ref, batch, seed)
            lm = step(model, batch, seed)
        assert_same(ref, model, lr, lm, f"autocast step {seed}")
    # frozen lower half: the input of the first trainable block needs no grad
    for m in (ref, model):
        for p in m.model.embed_tokens.parameters():
            p.requires_grad_(False)
        for p in m.model.layers[0].parameters():
            p.requires_grad_(False)
    for seed in range(2):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "frozen")


def test_calling_twice_does_not_wrap_twice_and_undo():
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, "1GiB", "rotor", measure_options=FAST)
    scheduler.checkpoint(model, "2GiB", "periodic", measure_options=FAST)
    assert len(runners(model)) == 1 and runners(model)[0].planner == "periodic"
    fwd = model.transformer.h[0].forward
    assert fwd.own is None and fwd.function is type(model.transformer.h[0]).forward
    assert list(model.state_dict()) == list(ref.state_dict())  # names unchanged
    for seed in range(2):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "twice")
    undo(model)
    assert "forward" not in model.transformer.h[0].__dict__ and checkpointed(model) is None


def test_bad_arguments_fail_at_call_time():
    model, _ = make("gpt2")
    with pytest.raises(ValueError, match="planner.*5"):
        scheduler.checkpoint(model, "1GiB", planner=5)
    for bad in (0, -1, "0"):
        with pytest.raises(ValueError, match="budget"):
            scheduler.checkpoint(model, bad)
    with pytest.raises(ValueError, match="budget"):
        scheduler.wrap([nn.Linear(2, 2)], 0)
    with pytest.raises(ValueError, match="planner"):
        scheduler.wrap([nn.Linear(2, 2)], "1MiB", planner=5)
    with pytest.raises(ValueError, match="bandwidth"):
        scheduler.checkpoint(model, "1GiB", "pofo", bandwidth=-3)
    with pytest.raises(TypeError, match="colour"):
        scheduler.checkpoint(model, "1GiB", colour="red")
    with pytest.raises(ValueError, match="no submodule"):
        scheduler.checkpoint(model, "1GiB", blocks="transformer.nope")
    with pytest.raises(ValueError, match="blocks="):
        scheduler.checkpoint(nn.Linear(3, 3), "1GiB")
    assert checkpointed(model) is None  # nothing installed by a failed call
    # HF's own checkpointing on (transformers >= 5.2x: activation_*, the gradient_* names
    # deprecated aliases; older: gradient_* only): refused, naming the call that turns it off
    new_names = hasattr(model, "activation_checkpointing_enable")
    (model.activation_checkpointing_enable if new_names else model.gradient_checkpointing_enable)()
    with pytest.raises(ValueError, match="activation_checkpointing_disable" if new_names
                       else "gradient_checkpointing_disable"):
        scheduler.checkpoint(model, "1GiB")


# ------------------------------------------------------------------------------ KV cache
def with_cache(name: str) -> Tuple[nn.Module, Dict[str, Any]]:
    """``name`` with its KV cache on, as every pretrained causal LM's config has it."""
    model, batch = make(name)
    model.config.use_cache = True
    for module in model.modules():  # T5's decoder stack keeps a config of its own
        config = getattr(module, "config", None)
        if getattr(config, "is_decoder", False):
            config.use_cache = True
    return model, batch


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_kv_cache_on_training_runs_without_it(name, monkeypatch):
    """A block recomputed in the backward would write its KV cache twice: training steps run
    the blocks without it, as HF's own checkpointing does (said once), bit-identical to plain
    training without the cache. For Llama that is plain training with it too; T5 sums the
    encoder's gradient in another order when its cache is on (1-ulp differences)."""
    monkeypatch.setattr(scheduler.runtime.hf_guards.KVCacheGuard, "warned", False)
    ref, batch = with_cache(name)
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, budgets(name)[0], "rotor", measure_options=FAST)
    with pytest.warns(UserWarning, match="without their KV cache"):
        step(model, batch, 0)  # profiling step
    for seed in range(1, 3):
        lm = step(model, batch, seed)
        assert_same(ref, model, step(ref, dict(batch, use_cache=False), seed), lm,
                    f"{name} step {seed} against plain use_cache=False")
        if name == "llama":
            assert_same(ref, model, step(ref, batch, seed), lm, f"llama step {seed}")
    assert sum(r.last_stats.recomputed_forwards for r in runners(model)) > 0
    if name == "llama":  # without gradients nothing is recomputed: generation keeps its cache
        ref.eval(), model.eval()
        prompt = batch["input_ids"][:, :4]
        with torch.no_grad():
            want = ref.generate(prompt, max_new_tokens=3, do_sample=False)
            assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False), want)


def test_kv_cache_off_in_eval_with_gradients_and_by_position():
    """The runner steps whenever gradients are wanted, eval mode included (saliency, or
    fine-tuning without dropout): the cache is off there too, and when use_cache comes by
    position to the module looping over the blocks."""
    ref, batch = with_cache("llama")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, budgets("llama")[0], "rotor", measure_options=FAST)
    ref.eval(), model.eval()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without their KV cache")
        for seed in range(3):
            assert_same(ref, model, step(ref, dict(batch, use_cache=False), seed),
                        step(model, batch, seed), f"eval step {seed}")
        assert runners(model)[0].last_stats.recomputed_forwards > 0
        ref.train(), model.train()
        ids = batch["input_ids"]
        try:  # transformers 5.2x's own decorators refuse use_cache by position
            ref.model(ids, None, None, None, None, False)
        except TypeError:
            return
        for seed in range(3, 5):
            got = []
            for m, on in ((ref, False), (model, True)):  # (ids, mask, positions, cache, embeds, use_cache)
                m.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                out = m.model(ids, None, None, None, None, on)
                out.last_hidden_state.square().mean().backward()
                got.append(out.last_hidden_state.detach())
            assert torch.equal(*got), f"by position, step {seed}"
        assert runners(model)[0].last_stats.recomputed_forwards > 0


def test_prefix_kv_cache_in_training_raises():
    """A cache that already holds positions cannot be dropped without training on something
    else: refused, naming the block and how many positions it held."""
    model, batch = with_cache("llama")
    ids = batch["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids[:, :4], use_cache=True)
    past = getattr(out, "cache", None) or out.past_key_values   # transformers >= 5.2x: cache
    if isinstance(past, tuple):  # transformers 4.4x returns its legacy form
        past = transformers.DynamicCache.from_legacy_cache(past)
    scheduler.checkpoint(model, "1GiB", "rotor", measure_options=FAST)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with pytest.raises(ValueError, match="block 0 .*already holds 4 positions"):
        model(input_ids=ids[:, 4:], labels=ids[:, 4:], **{name: past})


class Cached(nn.Module):
    """Not Hugging Face's: a block whose own ``cache=`` argument is a tensor it adds."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + cache


class CachedLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Cached() for _ in range(4))
        self.register_buffer("bias", torch.randn(8))

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        self.use_cache = use_cache  # its own meaning: not turned off for it
        for layer in self.layers:
            x = layer(x, cache=self.bias)
        return x.square().mean()


def test_a_non_hf_argument_named_cache_is_left_alone():
    torch.manual_seed(0)
    ref = CachedLoop()
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, None, plan_from_checkpoints(4, range(4)))
    x = torch.randn(3, 8)
    for m in (ref, model):
        m(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()))
    assert runners(model)[0].last_stats.recomputed_forwards == 4
    assert model.use_cache is True


def test_many_input_shapes_say_how_to_avoid_profiling_each():
    """Dynamic padding under rotor profiles every new length (an extra forward and backward
    of every block each): said once, at the 8th, naming the planners that predict shapes."""
    ref, _ = make("gpt2")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, "1GiB", "rotor", measure_options=FAST)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for length in range(4, 14):
            ids = torch.randint(0, VOCAB, (2, length))
            model(input_ids=ids, labels=ids).loss.backward()
    ours = [str(w.message) for w in said if "input shapes so far" in str(w.message)]
    assert len(ours) == 1 and "planner='mimose'" in ours[0] and "InputAwareChain" in ours[0]
    assert runners(model)[0].stats()["chains_measured"] == 10
    # new budgets on one shape plan on the chain measured for it: no measurement, no word
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, "1GiB", "rotor", measure_options=FAST)
    (runner,) = runners(model)
    low = None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for seed in range(6):
            if seed >= 2:  # from rotor's smallest budget up
                low = low or rotor.min_memory(runner.last_plan.chain)
                runner.budget = int(low * (1.1 + 0.3 * (seed - 2)))
            assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed),
                        f"budget step {seed}")
            if seed >= 2:
                assert runner.last_plan.planner == "rotor"
    assert runner.stats()["chains_measured"] == 1 and runner.stats()["profiling_steps"] == 1
    assert runner.stats()["misses"] == 5  # a plan per budget (and the first)
    assert not [w for w in said if "input shapes so far" in str(w.message)]


def test_a_legacy_prefix_cache_is_refused_too():
    """transformers 4's blocks take the cache as tuples of key and value tensors: one that
    holds positions is refused like a Cache; an empty one is dropped."""
    from scheduler.runtime.hf_guards import KVCacheGuard
    block = type("Block", (nn.Linear,), {"__module__": "transformers.models.fake"})(2, 2)
    full = (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="block 1 .*already holds 3 positions"):
        KVCacheGuard.clean(block, 1, (), {"layer_past": full})
    empty = (torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, kwargs = KVCacheGuard.clean(block, 1, (), {"layer_past": empty, "use_cache": True})
    assert kwargs == {"layer_past": None, "use_cache": False}


def test_hf_checkpointing_turned_on_afterwards_raises():
    """HF's checkpointing on top of the plan would checkpoint every block twice (the plan's
    recomputations recomputed again): refused at the step, then fine once turned off."""
    ref, batch = make("llama")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, "1GiB", "rotor", measure_options=FAST)
    new_names = hasattr(model, "activation_checkpointing_enable")
    (model.activation_checkpointing_enable if new_names else model.gradient_checkpointing_enable)()
    with pytest.raises(RuntimeError, match="turned on for block 0 .*after scheduler.checkpoint"):
        step(model, batch, 0)
    (model.activation_checkpointing_disable if new_names
     else model.gradient_checkpointing_disable)()
    for seed in range(2):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "after")


# ------------------------------------------------------------------------------ LoRA
def test_lora_adapters_with_peft():
    """Fine-tuning with LoRA (peft): the base weights frozen, adapters with dropout inside the
    blocks. Profiling step, rotor at its smallest budget and every block recomputed: losses
    and the adapters' gradients bit-identical to plain training, none on the base weights."""
    import peft  # a test dependency (pyproject [test])
    base, batch = with_cache("llama")  # peft's forward takes no use_cache: the blocks drop it
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    ref = peft.get_peft_model(base, lora)
    ref.train()
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, "1TiB", "rotor", measure_options=FAST)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without their KV cache")
        for seed in range(2):
            assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed),
                        f"step {seed}")
    (runner,) = runners(model)
    assert runner.L == 4
    low = rotor.min_memory(runner.last_plan.chain)
    for planner in ("rotor", plan_from_checkpoints(4, range(4))):
        scheduler.checkpoint(model, int(low * 1.1), planner, **fast(planner))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without their KV cache")
            for seed in range(2, 5):
                assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed),
                            f"{planner} step {seed}")
        assert runners(model)[0].last_stats.recomputed_forwards > 0
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    # adapters added after the call: they live inside the blocks the runner calls
    late, _ = with_cache("llama")  # the same weights (get_peft_model changed base in place)
    scheduler.checkpoint(late, None, plan_from_checkpoints(4, range(4)))
    late = peft.get_peft_model(late, lora)
    late.load_state_dict(ref.state_dict())
    late.train()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without their KV cache")
        for seed in range(2):
            assert_same(ref, late, step(ref, batch, seed), step(late, batch, seed),
                        f"adapters added after, step {seed}")
    assert runners(late.get_base_model())[0].last_stats.recomputed_forwards == 4


# ------------------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("name", ["llama", "t5"])
def test_torch_compile_of_the_model(name):
    """torch.compile(model) over a checkpointed model: the blocks' calls go through the runner
    eagerly (a graph break each), the rest is compiled. With aot_eager (AOTAutograd's graphs,
    eager kernels: no CPU compiler needed) every step is bit-identical to eager plain
    training, the profiling step included, and a planned step compiles nothing new."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    ref, batch = make(name)
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, budgets(name)[0], "rotor", measure_options=FAST)
    compiled = torch.compile(model, backend="aot_eager")
    for seed in range(4):  # profiling step, then the plan
        if seed == 3:
            frames = counters["frames"]["total"]
        assert_same(ref, model, step(ref, batch, seed), step(compiled, batch, seed),
                    f"{name} compiled step {seed}")
    assert counters["frames"]["total"] == frames, "a planned step compiled again"
    assert sum(r.last_stats.recomputed_forwards for r in runners(model)) > 0
    torch._dynamo.reset()


def test_torch_compile_inductor_after_the_profiling_step():
    """With inductor, the steps after the profiling step are bit-identical to compiled plain
    training with the same graph breaks (the blocks' forwards run eagerly there too); the
    profiling step measures the tail under the op tracer, which may change its last bits. A
    graph break at each block and no more (the runner's and the tail's hooks are not
    traced)."""
    from torch._dynamo.utils import counters
    from scheduler.runtime.checkpoint import find_blocks
    torch._dynamo.reset()
    counters.clear()
    ref, batch = make("llama")
    model = copy.deepcopy(ref)
    for _, blocks in find_blocks(ref):
        for block in blocks:
            block.forward = torch.compiler.disable(block.forward)
    scheduler.checkpoint(model, budgets("llama")[0], "rotor", measure_options=FAST)
    compiled_ref, compiled = torch.compile(ref), torch.compile(model)
    for seed in range(4):
        lr, lm = step(compiled_ref, batch, seed), step(compiled, batch, seed)
        if seed > 0:
            assert_same(ref, model, lr, lm, f"inductor step {seed}")
    assert sum(r.last_stats.recomputed_forwards for r in runners(model)) > 0
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    assert 0 < breaks <= 2 * 4, dict(counters["graph_break"])  # ours and the reference's


def test_fullgraph_names_scheduler_and_what_to_do():
    """fullgraph=True over a checkpointed model refuses the graph break at the first block
    call; Dynamo's error quotes the reason the runner's entry gives: scheduler named, and
    what works instead."""
    torch._dynamo.reset()
    model, batch = make("llama")
    scheduler.checkpoint(model, budgets("llama")[0], "rotor", measure_options=FAST)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"reason: scheduler.checkpoint runs each checkpointed block "
                             r"eagerly.*compile the blocks themselves before"):
        step(compiled, batch, 0)
    torch._dynamo.reset()


def _counting_backend(runs: List[int]) -> Callable[..., Any]:
    """aot_eager (AOTAutograd's graphs: a compiled block saves other tensors than eager),
    counting the runs of the graphs it compiled."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            runs[0] += 1
            return compiled(*args)
        return run
    return backend


def _compile_blocks(model: nn.Module, backend: Any, how: str) -> None:
    layers = model.model.layers
    for i, block in enumerate(layers):
        if how == "block.compile()":
            block.compile(backend=backend)
        else:
            layers[i] = torch.compile(block, backend=backend)


@pytest.mark.parametrize("outer", [False, True])
def test_blocks_compiled_before_the_call_stay_compiled(outer):
    """Blocks compiled as the list's entries, then checkpointed: every run of every block
    is the compiled one (first runs and recomputations, the profiling step included) and
    each step is bit-identical to compiled plain training. The profiling step's op tracer
    (a dispatch mode) used to make Dynamo skip the block's code for good: the recomputation
    then ran it eagerly, saving other tensors than its compiled first run (a RuntimeError at
    the first step), and the blocks ran eagerly ever after. ``outer``: torch.compile(model)
    on top, which traced the compiled entries' ``_orig_mod``, past the runner (no plan at
    all, said only as "never called the blocks")."""
    torch._dynamo.reset()
    ref, batch = make("llama")
    model = copy.deepcopy(ref)
    ref_runs, runs = [0], [0]
    _compile_blocks(ref, _counting_backend(ref_runs), "torch.compile")
    _compile_blocks(model, _counting_backend(runs), "torch.compile")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        scheduler.checkpoint(model, budgets("llama")[0], "rotor", measure_options=FAST)
        run = torch.compile(model, backend="aot_eager") if outer else model
        for seed in range(3):  # profiling step, then the plan
            before = runs[0]
            assert_same(ref, model, step(ref, batch, seed), step(run, batch, seed),
                        f"compiled blocks, step {seed}")
            (runner,) = runners(model)
            ran = runner.L + runner.last_stats.recomputed_forwards
            # (the profiling step's measurement times the blocks compiled too)
            assert runs[0] - before >= ran if seed == 0 else runs[0] - before == ran, \
                f"step {seed}: {runs[0] - before} compiled runs for {ran} block runs"
    assert runner.last_stats.recomputed_forwards > 0 and runner.profiling_steps == 1
    assert not [w for w in said if "compiled around" in str(w.message) or
                "never called the blocks" in str(w.message)]
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["block.compile()", "torch.compile after"])
def test_a_compile_around_the_runner_is_said(how):
    """block.compile(), or torch.compile(block) put in the list after the call, wraps the
    call the runner intercepts: the blocks run eagerly. Said once, at the user's line; the
    gradients are still plain training's."""
    torch._dynamo.reset()
    ref, batch = make("llama")
    model = copy.deepcopy(ref)
    runs = [0]
    if how == "block.compile()":
        _compile_blocks(model, _counting_backend(runs), how)
    scheduler.checkpoint(model, budgets("llama")[0], "rotor", measure_options=FAST)
    if how != "block.compile()":
        _compile_blocks(model, _counting_backend(runs), how)
    with pytest.warns(UserWarning, match=r"block\(s\) \[0, 1, 2, 3\] of 'model.layers' are "
                      "compiled around") as said:
        for seed in range(2):
            assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed),
                        f"{how}, step {seed}")
    assert sum("compiled around" in str(w.message) for w in said) == 1
    assert all(w.filename == __file__ for w in said if "compiled around" in str(w.message))
    assert runs[0] == 0  # what the warning says: nothing of the blocks ran compiled
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ CNN
class Stage(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.bn(self.conv(x)))) * scale


class SkipCNN(nn.Module):
    """Not a sequence: the stem's output skips over the stages to the head, and a tensor
    computed once (scale) is passed to every stage."""

    def __init__(self, c: int = 4, n: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.stages = nn.ModuleList(Stage(c) for _ in range(n))
        self.gate = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.stem(x)
        scale = torch.sigmoid(self.gate)
        h = h0
        for stage in self.stages:
            h = stage(h, scale=scale)
        return self.head((h + h0).mean((2, 3)))


def test_non_sequential_cnn_with_its_block_list():
    torch.manual_seed(0)
    ref = SkipCNN()
    x = torch.randn(2, 3, 8, 8)
    probe = copy.deepcopy(ref)
    scheduler.checkpoint(probe, 1 << 40, blocks="stages", measure_options=FAST)
    for seed in range(2):  # profiling step, then the plan (with the measured chain)
        probe(x).sum().backward()
    chain = runners(probe)[0].last_plan.chain
    full = simulate(chain, plan_from_checkpoints(chain.L, [])).peak_memory
    low = int(rotor.min_memory(chain) + 0.05 * (full - rotor.min_memory(chain))) + 1
    for planner, budget in (("rotor", low), ("pofo", low), ("periodic", full),
                            ("mimose", (low + full) // 2)):
        model = copy.deepcopy(ref)
        scheduler.checkpoint(model, budget, planner, blocks="stages", track_memory=True,
                             **fast(planner))
        for seed in range(3):
            for m in (ref, model):
                m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            lr = ref(x).square().sum()
            lr.backward()
            torch.manual_seed(seed)
            lm = model(x).square().sum()
            lm.backward()
            assert_same(ref, model, lr, lm, f"cnn {planner} step {seed}")
        assert all(torch.equal(a, b) for a, b in zip(ref.buffers(), model.buffers()))
        r = runners(model)[0]
        assert r.stats()["last_peak_bytes"] <= r.last_plan.predicted_peak


# ------------------------------------------------------------------------------ Trainer
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch_compile"])
def test_hf_trainer_loss_curve_identical(tmp_path, compiled):
    """HF's Trainer, gradient accumulation, and its torch_compile=True (aot_eager: AOTAutograd
    with eager kernels, so plain training's losses are the reference)."""
    from transformers import Trainer, TrainingArguments
    compile_args = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, VOCAB, (8, 12), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def curve(model: nn.Module) -> List[float]:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                 max_steps=4, learning_rate=1e-3, logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=True, seed=0,
                                 gradient_accumulation_steps=2, dataloader_num_workers=0,
                                 disable_tqdm=True, **compile_args)
        trainer = Trainer(model=model, args=args, train_dataset=Data())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ref, _ = make("gpt2")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, budgets("gpt2")[0], "rotor", measure_options=FAST)
    plain = curve(ref)
    ours = curve(model)
    assert len(plain) == 4 and plain == ours
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    assert runners(model)[0].last_plan.planner == "rotor"
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ loops
class Loop(nn.Module):
    """A loop that changes the value between blocks (block 2's output is scaled) and may
    skip a block."""

    def __init__(self, skip: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3))
                                    for _ in range(4))
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.layers):
            if self.skip and i == 1:
                continue
            x = b(x) * 1.5 if i == 2 else b(x)
        return x.square().sum()


def test_changed_values_retain_graph_and_skipped_blocks():
    torch.manual_seed(0)
    ref = Loop()
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, None, plan_from_checkpoints(4, [0, 1, 2, 3]), blocks="layers")
    x = torch.randn(3, 8, requires_grad=True)
    grads = []
    for m in (ref, model):
        torch.manual_seed(1)
        loss = m(x)
        g1 = torch.autograd.grad(loss, [x] + list(m.parameters()), retain_graph=True)
        g2 = torch.autograd.grad(loss, [x] + list(m.parameters()))  # the graph was retained
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
        grads.append(g1)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert runners(model)[0].last_stats.recomputed_forwards == 4
    skipping = Loop(skip=True)
    scheduler.checkpoint(skipping, "1MiB", blocks="layers")
    with pytest.raises(RuntimeError, match="block 2 was called but block 1 was expected"):
        skipping(x)


def test_dropped_values_are_really_freed():
    """Storages, not the runner's bookkeeping: after the forward, a value the plan drops
    (F_none) is gone from memory, a checkpoint (F_ck) is not, and the backward still gives
    plain training's gradients."""
    import weakref
    from scheduler import Plan

    torch.manual_seed(0)
    ref = Loop()
    plan = Plan([("F_ck", 0), ("F_none", 1), ("F_none", 2), ("F_ck", 3), ("F_all", 4),
                 ("B", 4), ("F_all", 3), ("B", 3), ("F_ck", 0), ("F_ck", 1), ("F_all", 2),
                 ("B", 2), ("F_all", 1), ("B", 1), ("F_all", 0), ("B", 0)])
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, None, plan, blocks="layers")
    outs: List[Any] = []
    for b in model.layers:
        b.register_forward_hook(lambda m, a, o: outs.append(weakref.ref(o.untyped_storage())))
    x = torch.randn(3, 8)
    torch.manual_seed(1)
    loss = model(x)
    alive = [r() is not None for r in outs]
    # x[1], x[2] dropped; x[3] checkpointed; the last output (x[4]) read by the loss
    assert alive == [False, False, True, True]
    loss.backward()
    torch.manual_seed(1)
    ref(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()))


# ------------------------------------------------------------------ input-aware chains
def test_input_aware_chain_under_checkpoint_learns_on_profiling_steps():
    """``chain=InputAwareChain(...)`` under scheduler.checkpoint (what the runner recommends for
    dynamic padding): the blocks take the model's keyword arguments, so the source cannot run
    them itself; the runner measures each new size on a profiling step (with the model's
    tail) and teaches it to the source, which predicts every size after ``samples``. Gradients
    stay bit-identical, before and after the estimator is fitted."""
    from scheduler.runtime.input_aware import InputAwareChain
    ref, _ = make("gpt2")
    model = copy.deepcopy(ref)
    src = InputAwareChain(model.transformer.h, samples=3, measure_options=FAST)
    hi = budgets("gpt2")[1]
    scheduler.checkpoint(model, budget=hi, planner="rotor", chain=src)
    (r,) = runners(model)
    lengths = [6, 8, 10, 12, 14, 9]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no "measured N shapes" advice
        warnings.filterwarnings("ignore", message=".*(use_cache|loss_type).*")
        for i, n in enumerate(lengths):
            ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(i))
            batch = {"input_ids": ids, "labels": ids}
            assert_same(ref, model, step(ref, batch, i), step(model, batch, i), f"length {n}")
    st = src.stats()
    assert st["measurements"] == 3 and not st["collecting"], st
    assert st["predictions"] == len(lengths) - 3, st     # every later size predicted
    assert r.profiling_steps == 3                         # and none of them profiled
    assert r.last_plan.chain.meta["source"] == "ChainEstimator"   # planned on a prediction
